"""`densekit quickstart`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from densekit.cli.options import BatchOpt, DeviceOpt, ProgressOpt

console = Console()


def quickstart(
    data: Annotated[
        Path | None, typer.Option(help="SciFact in BEIR layout (default: ../shared/data/scifact).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Where runs, embeddings and metrics.json go.")] = Path(
        "quickstart-output"
    ),
    batch_size: BatchOpt = 64,
    device: DeviceOpt = "auto",
    progress: ProgressOpt = True,
) -> None:
    """BM25 and zero-shot all-MiniLM-L6-v2 on SciFact's test split, beside the published figures.

    Takes about three minutes on two CPU cores (encoding the corpus); a second run reuses the embeddings.
    """
    from densekit.quickstart import PUBLISHED, default_data_dir, run_quickstart

    metrics = run_quickstart(data or default_data_dir(), out, batch_size, device, progress)
    table = Table(title=f"SciFact test (300 queries) -> {out}/metrics.json")
    for column in ("system", "nDCG@10", "published nDCG@10", "RR@10", "R@100", "R@1000", "AP"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for system, scores in metrics.items():
        published = PUBLISHED[system]
        table.add_row(
            system,
            f"{scores['nDCG@10']:.3f}",
            f"{published.ndcg_at_10:.3f} ({published.source})",
            *(f"{scores[m]:.3f}" for m in ("RR@10", "R@100", "R@1000", "AP")),
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add the quickstart to `app`."""
    app.command("quickstart")(quickstart)
