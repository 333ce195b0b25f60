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
    allow_outside_out: Annotated[
        bool,
        typer.Option(
            "--allow-outside-out",
            help="Let the recipe's steps write outside --out (a path with .., an absolute path, a link out "
            "of it); without it such a recipe is refused before any step runs.",
        ),
    ] = False,
    progress: ProgressOpt = True,
) -> None:
    """Run a recipe's steps in order, skipping those already done: a killed run continues.

    A step whose parameters or inputs changed since it last ran is run again, with the steps after it.
    --out must be new, empty or a run of a recipe with the same steps, or with steps added after them
    (--overwrite replaces the outputs densekit made there for another recipe). Every step writes inside
    --out unless --allow-outside-out; recipes and configs are bounded (docs/hostile-input.md). The
    recipe's `expected` scores are set beside the run's only on the collection they were measured on
    (docs/evaluation.md); a step that leaves something out says so, naming the file that lists it.
    """
    from densekit.recipes.runner import run_recipe

    metrics = run_recipe(recipe, out, overrides or [], device, progress, overwrite, allow_outside_out)
    Console().print_json(data=metrics)


def register(app: typer.Typer) -> None:
    """Add `run` to `app`."""
    app.command("run")(run)
