"""A model rotated onto the principal directions of the corpus it will search (`densekit rotate`, a
recipe's `rotate` step): fitted on a sample of the corpus vectors the model itself made, and with
`fit="ranking"` turned further so that its cut vectors rank that sample as its full-width ones do
(`models.ranking_rotation`), for the queries given or the corpus's own vectors."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from densekit.data import Dataset
from densekit.encoding.embed import embed_texts
from densekit.encoding.store import EmbeddingStore
from densekit.errors import InputError
from densekit.io.outputs import check_artefact_output, check_not_input
from densekit.limits import MAX_RANKING_ANCHORS, MAX_RANKING_CANDIDATES
from densekit.models.config import RotationFit
from densekit.models.encoder import MODEL_KIND, DenseEncoder
from densekit.models.ranking_rotation import fit_ranking_rotation
from densekit.models.rotation import Rotation, energy_shares, fit_rotation, put_rotation
from densekit.retrieval.dense import check_passages_made_by
from densekit.routing.model_or_route import load_model_or_route

log = logging.getLogger("densekit")

CHUNK_ROWS = 65_536
REPORTED_WIDTHS = (512, 256, 128, 64, 32)
RANKING_WIDTHS = (256, 128, 64)


def rotate_model(
    model: str,
    embeddings: Path,
    output: Path,
    sample: int = 100_000,
    seed: int = 0,
    overwrite: bool = False,
    fit: RotationFit = "variance",
    queries: Path | None = None,
    split: str = "train",
    widths: Sequence[int] | None = None,
) -> Rotation:
    """Save `model` rotated by the rotation fitted on `sample` vectors (drawn with `seed`) of the corpus
    embeddings it made, `embeddings`, to the model folder `output`, and return the rotation. With
    `fit="ranking"` the rotation is then refined for the cut `widths` (by default those of
    `RANKING_WIDTHS` below the model's width),
    anchored on the `split` queries of the collection `queries` (their texts, encoded by `model`; no
    judgement is used) or, with none, on corpus vectors. A module, a route, an untied model, embeddings
    cut to fewer dimensions or made by another model are refused."""
    inputs = [model, embeddings] + ([] if queries is None else [queries])
    check_not_input(output, inputs)
    if fit == "variance" and queries is not None:
        raise InputError(f"--queries {queries}: queries anchor a ranking fit (--fit ranking)")
    if fit == "variance" and widths is not None:
        raise InputError(f"--width {list(widths)}: --width shapes a ranking fit (--fit ranking)")
    if fit == "ranking" and sample > MAX_RANKING_CANDIDATES:
        raise InputError(f"sample {sample:,}: a ranking fit takes at most {MAX_RANKING_CANDIDATES:,} corpus "
                         "vectors (each anchor is scored against all of them)")  # fmt: skip
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
    if fit == "ranking":
        # the defaults serve any model: those at or above its width are left out; given ones are not
        kept = sorted(set(widths), reverse=True) if widths is not None else [
            w for w in RANKING_WIDTHS if w < encoder.width]  # fmt: skip
        if not kept:
            raise InputError(f"widths {list(RANKING_WIDTHS)}: none is below the model's {encoder.width} "
                             "dimensions: give --width")  # fmt: skip
        texts = None if queries is None else list(Dataset.open(queries).split_queries(split)[0].values())
        rotation = _ranking_rotation(encoder, store, sample, seed, texts, kept)
    else:
        rotation = fit_rotation(_sampled(store, sample, seed), encoder.width)
    put_rotation(encoder, rotation)
    check_artefact_output(output, MODEL_KIND, encoder.identity(), inputs, overwrite)
    encoder.save(output)
    kept = ", ".join(f"{w}: {rotation.kept(w):.3f}" for w in REPORTED_WIDTHS if w < encoder.width)
    log.info("wrote %s: %s with its dimensions ordered by %s vectors of %s; the share of their squared "
             "length the first N keep: %s", output, model, f"{rotation.rows:,}", embeddings,
             kept)  # fmt: skip
    return rotation


def _ranking_rotation(
    encoder: DenseEncoder, store: EmbeddingStore, sample: int, seed: int, queries: Sequence[str] | None,
    widths: Sequence[int],
) -> Rotation:
    """The principal directions of the sample, refined for the cut `widths` (widest first), anchored on
    `queries` or, with None, on corpus vectors."""
    corpus = np.concatenate(list(_sampled(store, sample, seed)))
    start = fit_rotation([corpus], encoder.width)
    rng = np.random.default_rng(seed)
    if queries is not None:
        texts = list(queries)
        if len(texts) > MAX_RANKING_ANCHORS:
            texts = [texts[i] for i in np.sort(rng.choice(len(texts), MAX_RANKING_ANCHORS, replace=False))]
        anchors, anchor_rows = embed_texts(encoder, texts, "query"), None
        source = f"{len(texts):,} queries"
    else:
        anchor_rows = np.sort(rng.choice(len(corpus), min(len(corpus), MAX_RANKING_ANCHORS), replace=False))
        anchors = corpus[anchor_rows]
        source = f"{len(anchors):,} corpus vectors"
    refined = fit_ranking_rotation(start.matrix, anchors, corpus, widths, encoder.config.normalize, seed,
                                   anchor_rows)  # fmt: skip
    log.info("ranking fit for widths %s on %s: held-out loss %.4f -> %.4f after %d steps", widths, source,
             refined.start_loss, refined.loss, refined.steps)  # fmt: skip
    return Rotation(refined.matrix, energy_shares(corpus, refined.matrix), len(corpus))


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
