"""A model rotated onto the principal directions of the corpus it will search (`densekit rotate`, a
recipe's `rotate` step): fitted on a sample of the corpus vectors the model itself made."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from densekit.encoding.store import EmbeddingStore
from densekit.errors import InputError
from densekit.io.outputs import check_artefact_output, check_not_input
from densekit.models.encoder import MODEL_KIND
from densekit.models.rotation import Rotation, fit_rotation, put_rotation
from densekit.retrieval.dense import check_passages_made_by
from densekit.routing.model_or_route import load_model_or_route

log = logging.getLogger("densekit")

CHUNK_ROWS = 65_536
REPORTED_WIDTHS = (512, 256, 128, 64, 32)


def rotate_model(
    model: str, embeddings: Path, output: Path, sample: int = 100_000, seed: int = 0, overwrite: bool = False
) -> Rotation:
    """Save `model` rotated by the rotation fitted on `sample` vectors (drawn with `seed`) of the corpus
    embeddings it made, `embeddings`, to the model folder `output`, and return the rotation. A module,
    a route, an untied model, embeddings cut to fewer dimensions or made by another model are refused."""
    check_not_input(output, [model, embeddings])
    store = EmbeddingStore.open(embeddings)
    encoder, route = load_model_or_route(model, "cpu")
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
    check_artefact_output(output, MODEL_KIND, encoder.identity(), [model, embeddings], overwrite)
    encoder.save(output)
    kept = ", ".join(f"{w}: {rotation.kept(w):.3f}" for w in REPORTED_WIDTHS if w < encoder.width)
    log.info("wrote %s: %s with its dimensions ordered by %s vectors of %s; the share of their squared "
             "length the first N keep: %s", output, model, f"{rotation.rows:,}", embeddings,
             kept)  # fmt: skip
    return rotation


def _sampled(store: EmbeddingStore, sample: int, seed: int) -> Iterator[np.ndarray]:
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
