"""The `rotate` sub-command: a model whose dimensions are ordered by a corpus's variance."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from densekit.cli.options import ModelArg, OverwriteOpt, load_model
from densekit.errors import InputError
from densekit.models.config import EncoderOptions

log = logging.getLogger("densekit")

MAX_SAMPLE = 10_000_000  # rows read to fit on: a d x d sum, so rows cost time, not memory
CHUNK_ROWS = 65_536
REPORTED_WIDTHS = (512, 256, 128, 64, 32)


def rotate(
    model: ModelArg,
    embeddings: Annotated[
        Path, typer.Argument(help="An embedding folder MODEL made of the corpus to order by (encode).")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The model folder to write.")],
    sample: Annotated[
        int, typer.Option("--sample", min=1, max=MAX_SAMPLE, help="Vectors to fit on, drawn with --seed.")
    ] = 100_000,
    seed: Annotated[int, typer.Option("--seed", help="Draws the sample.")] = 0,
    overwrite: OverwriteOpt = False,
) -> None:
    """Order MODEL's dimensions by the variance of a corpus's vectors and save it as a new model, so
    that its vectors cut to their first N (`--dimensions N`, sentence-transformers' `truncate_dim`) keep
    the most of them for any N. An orthogonal rotation after the pooling (a Dense module): full-width
    vectors score exactly as MODEL's. Fit it on the corpus you will search (docs/compression.md)."""
    from densekit.encoding.store import EmbeddingStore
    from densekit.io.outputs import check_not_input, claim_folder
    from densekit.models.encoder import MODEL_KIND
    from densekit.models.rotation import fit_rotation, put_rotation
    from densekit.retrieval.dense import check_passages_made_by

    check_not_input(output, [model, embeddings])
    store = EmbeddingStore.open(embeddings)
    encoder, route = load_model(model, "cpu", EncoderOptions())
    if route is not None or encoder.own is not None:
        raise InputError(f"{model}: give a model folder; a rotation is fitted to a model, not to a module")
    if not encoder.config.tied:
        raise InputError(f"{model} has a query and a passage tower: densekit rotates a tied encoder only")
    if store.dimension != encoder.width:
        raise InputError(f"{embeddings} holds {store.dimension}-dimensional vectors; {model} makes "
                         f"{encoder.width}: encode the corpus without --dimensions")  # fmt: skip
    check_passages_made_by(encoder, store.identity, f"{embeddings} was encoded")
    rotation = fit_rotation(_sampled(store, sample, seed), encoder.width)
    put_rotation(encoder, rotation)
    claim_folder(output, MODEL_KIND, encoder.identity(), [model, embeddings], overwrite)
    encoder.save(output)
    kept = ", ".join(f"{w}: {rotation.kept(w):.3f}" for w in REPORTED_WIDTHS if w < encoder.width)
    log.info("wrote %s: %s with its dimensions ordered by %s vectors of %s; the share of their squared "
             "length the first N keep: %s", output, model, f"{rotation.rows:,}", embeddings,
             kept)  # fmt: skip


def _sampled(store, sample: int, seed: int) -> Iterator[np.ndarray]:
    """Chunks of `sample` rows of `store` drawn with `seed` (every row when it holds no more), in
    corpus order, read from each part's memory-mapped vectors."""
    total = len(store)
    chosen = (
        np.arange(total)
        if sample >= total
        else np.sort(np.random.default_rng(seed).choice(total, size=sample, replace=False))
    )
    first = 0
    for part in store.parts:
        rows = int(part.meta["rows"])
        inside = chosen[(chosen >= first) & (chosen < first + rows)] - first
        vectors = part.vectors()
        for start in range(0, len(inside), CHUNK_ROWS):
            yield np.asarray(vectors[inside[start : start + CHUNK_ROWS]], dtype=np.float32)
        first += rows


def register(app: typer.Typer) -> None:
    """Add this sub-command to `app`."""
    app.command("rotate")(rotate)
