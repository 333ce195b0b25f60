"""The `import-embeddings` sub-command: vectors encoded elsewhere, as an embedding folder."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from densekit.cli.options import (
    DataDirArg,
    ModelArg,
    OverwriteOpt,
    ProgressOpt,
    load_model,
    with_encoder_options,
)
from densekit.data.dataset import Dataset
from densekit.models.config import EncoderOptions

log = logging.getLogger("densekit")


@with_encoder_options
def import_embeddings(
    model: ModelArg,
    data_dir: DataDirArg,
    vectors: Annotated[
        Path, typer.Argument(help="A float32 .npy of shape (rows, dimension): row i is document i's vector.")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The embedding folder to write.")],
    ids: Annotated[
        Path | None,
        typer.Option("--ids", help="The rows' document ids, one a line (default: the corpus's order)."),
    ] = None,
    encoder_options: EncoderOptions = EncoderOptions(),
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Make an embedding folder from vectors encoded elsewhere, for `index` and `search` to use as one
    `densekit encode` made. MODEL (and the setting options) must be the model and settings that encoded
    them: `search` encodes queries with it. The rows must be the corpus's documents in corpus order.
    """
    from densekit.encoding.imported import import_embeddings as run_import

    encoder, _ = load_model(model, "cpu", encoder_options)
    run_import(encoder, Dataset.open(data_dir), vectors, output, ids, overwrite, progress)
    log.info("wrote %s", output)


def register(app: typer.Typer) -> None:
    """Add this sub-command to `app`."""
    app.command("import-embeddings")(import_embeddings)
