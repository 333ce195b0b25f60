"""`densekit run`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from densekit.cli.options import DeviceOpt, OverwriteOpt, ProgressOpt


def run(
    recipe: Annotated[Path, typer.Argument(help="A recipe YAML (see recipes/).")],
    out: Annotated[Path, typer.Option("--out", help="Where every step's output and metrics.json go.")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="Overrides as dotted.key=value, e.g. data.path=/some/beir/folder."),
    ] = None,
    device: DeviceOpt = "auto",
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Run a recipe's steps in order, skipping those already done: a killed run continues.

    A step whose parameters or inputs changed since it last ran is run again, with the steps after it.
    --out must be new, empty or a run of a recipe with the same steps, or with steps added after them
    (--overwrite replaces the outputs densekit made there for another recipe).
    """
    from densekit.recipes.runner import run_recipe

    metrics = run_recipe(recipe, out, overrides or [], device, progress, overwrite)
    Console().print_json(data=metrics)


def register(app: typer.Typer) -> None:
    """Add `run` to `app`."""
    app.command("run")(run)
