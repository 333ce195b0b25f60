"""The `rotate` sub-command: a model whose dimensions are ordered by a corpus's variance."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from densekit.cli.options import ModelArg, OverwriteOpt, check_model_inputs
from densekit.limits import MAX_ROTATION_SAMPLE
from densekit.models.config import EncoderOptions, RotationFit


def rotate(
    model: ModelArg,
    embeddings: Annotated[
        Path, typer.Argument(help="An embedding folder MODEL made of the corpus to order by (encode).")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The model folder to write.")],
    sample: Annotated[
        int,
        typer.Option(
            "--sample",
            min=1,
            max=MAX_ROTATION_SAMPLE,
            help="Vectors to fit on, drawn with --seed (at most 200,000 with --fit ranking).",
        ),
    ] = 100_000,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Draws the sample.")] = 0,
    fit: Annotated[
        RotationFit,
        typer.Option(
            "--fit",
            help="variance: the principal directions; ranking: turned from them so that cut vectors rank "
            "the sample as full-width ones do (docs/compression.md).",
        ),
    ] = "variance",
    queries: Annotated[
        Path | None,
        typer.Option(
            "--queries",
            help="A collection whose --split queries anchor a ranking fit (texts only; no judgement is "
            "used). Without it, corpus vectors do.",
        ),
    ] = None,
    split: Annotated[str, typer.Option("--split", help="The split of --queries.")] = "train",
    widths: Annotated[
        list[int] | None,
        typer.Option(
            "--width",
            min=1,
            help="A cut width a ranking fit serves (repeat it); by default 256, 128 and 64, those below the "
            "model's width.",
        ),
    ] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Order MODEL's dimensions by the variance of a corpus's vectors and save it as a new model, so
    that its vectors cut to their first N (`--dimensions N`, sentence-transformers' `truncate_dim`) keep
    the most of them for any N. An orthogonal rotation after the pooling (a Dense module): full-width
    vectors score exactly as MODEL's. Fit it on the corpus you will search (docs/compression.md); with
    `--fit ranking --queries DATA` it is turned further so that the cut vectors rank as full-width ones
    do for those queries, which keeps more at 128 or 64 dimensions."""
    from densekit.retrieval.corpus_rotation import rotate_model

    check_model_inputs(model, EncoderOptions())
    rotate_model(model, embeddings, output, sample, seed, overwrite, fit, queries, split, widths or None)


def register(app: typer.Typer) -> None:
    """Add this sub-command to `app`."""
    app.command("rotate")(rotate)
