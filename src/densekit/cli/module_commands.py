"""`densekit modules ...`: what to do with a trained module besides encoding with it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from densekit.cli.options import OverwriteOpt

log = logging.getLogger("densekit")

modules_app = typer.Typer(
    help="Work with parameter-efficient modules (docs/modules.md).", no_args_is_help=True
)


@modules_app.command("merge")
def merge(
    module: Annotated[Path, typer.Argument(help="A module folder (it names its base).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The full model folder to write.")],
    overwrite: OverwriteOpt = False,
) -> None:
    """Fold a LoRA or IA3 module into its base: a full model folder that transformers and
    sentence-transformers load, with the module's embeddings."""
    from densekit.io.outputs import claim_folder
    from densekit.models.encoder import MODEL_KIND, DenseEncoder
    from densekit.models.modules.merge import merged_encoder

    encoder = DenseEncoder.load(module)
    merged = merged_encoder(encoder)
    claim_folder(output, MODEL_KIND, merged.identity(), [module], overwrite)
    merged.save(output)
    log.info("wrote %s: %s with module %s folded in", output, encoder.source, encoder.active)


def register(app: typer.Typer) -> None:
    """Add the `modules` command group to `app`."""
    app.add_typer(modules_app, name="modules")
