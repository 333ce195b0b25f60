"""`densekit quickstart`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from densekit.cli.options import BatchOpt, DeviceOpt, OverwriteOpt, ProgressOpt

console = Console()


def quickstart(
    data: Annotated[
        Path | None, typer.Option(help="A collection in BEIR layout (default: ../shared/data/scifact).")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Where runs, embeddings and metrics.json go (default: quickstart-output/NAME)."),
    ] = None,
    batch_size: BatchOpt = 64,
    device: DeviceOpt = "auto",
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """BM25 and zero-shot all-MiniLM-L6-v2 on a collection's test split, beside the published figures.

    Takes about three minutes on two CPU cores for SciFact (encoding the corpus); a second run on the
    same collection reuses the embeddings. Published figures are shown for SciFact and NFCorpus, which
    are recognised by the digest of their files, not by their folder's name.
    """
    from densekit.quickstart import DEFAULT_OUTPUT, default_data_dir, run_quickstart

    data = data or default_data_dir()
    out = out or DEFAULT_OUTPUT / data.resolve().name
    result = run_quickstart(data, out, batch_size, device, progress, overwrite)
    table = Table(title=f"{result.collection} test ({result.queries} queries) -> {out}/metrics.json")
    for column in ("system", "nDCG@10", "published nDCG@10", "RR@10", "R@100", "R@1000", "AP"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for system, scores in result.metrics.items():
        published = result.published.get(system)
        table.add_row(
            system,
            f"{scores['nDCG@10']:.3f}",
            f"{published.ndcg_at_10:.3f} ({published.source})" if published else "-",
            *(f"{scores[m]:.3f}" for m in ("RR@10", "R@100", "R@1000", "AP")),
        )
    console.print(table)
    if not result.published:
        console.print(
            f"[yellow]no published figures for {result.collection}: they are shown for SciFact and NFCorpus "
            "as BEIR distributes them[/]"
        )


def register(app: typer.Typer) -> None:
    """Add the quickstart to `app`."""
    app.command("quickstart")(quickstart)
