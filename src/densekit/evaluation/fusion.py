"""Fusing runs (a BM25 run with a dense one, say) into one: reciprocal rank fusion and score-normalised
linear fusion. Written here because ranx, which has both, pulls numba in for a few lines of work."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from densekit.data.records import Run
from densekit.errors import SettingError

Normalisation = Literal["minmax", "zscore"]


def check_weights(weights: Sequence[float] | None, runs: int, label: str | None = None) -> None:
    """Refuse weights that are not one per run, each finite and zero or more, at least one above 0 (all
    zero would score every document 0); the error starts with `label` (default: the weights)."""
    if weights is None:
        return
    label = label or f"weights {list(weights)}"
    if len(weights) != runs:
        raise SettingError(f"{label}: {len(weights)} weights for {runs} runs; give one weight per run")
    if any(not np.isfinite(w) or w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise SettingError(f"{label}: each must be a finite number, zero or more, and at least one above 0")


def _weights(runs: Sequence[Run], weights: Sequence[float] | None) -> list[float]:
    if len(runs) < 2:
        raise SettingError("fusion needs at least two runs")
    check_weights(weights, len(runs))
    return [1.0] * len(runs) if weights is None else list(weights)


def _top(scores: dict[str, float], depth: int) -> dict[str, float]:
    """The best `depth` documents; equal scores are ordered by document id, so fusion is deterministic."""
    ordered = sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))
    return dict(ordered[:depth])


def reciprocal_rank_fusion(
    runs: Sequence[Run], k: int = 60, weights: Sequence[float] | None = None, depth: int = 1000
) -> Run:
    """Cormack et al.'s RRF: a document scores sum_i w_i / (k + rank_i), its rank (from 1) in each run
    that retrieved it, ranks taken by score with ties in the run's order."""
    if k < 0:
        raise SettingError(f"k={k}: RRF's constant must be zero or more")
    weights = _weights(runs, weights)
    fused: Run = {}
    for run, weight in zip(runs, weights, strict=True):
        for query, ranked in run.items():
            scores = fused.setdefault(query, {})
            ordered = sorted(ranked, key=lambda doc: -ranked[doc])  # stable: ties keep the run's order
            for rank, doc in enumerate(ordered, start=1):
                scores[doc] = scores.get(doc, 0.0) + weight / (k + rank)
    return {query: _top(scores, depth) for query, scores in fused.items()}


def _normalised(ranked: dict[str, float], method: Normalisation) -> dict[str, float]:
    values = np.array(list(ranked.values()), dtype=np.float64)
    if method == "minmax":
        spread = values.max() - values.min()
        scaled = (values - values.min()) / spread if spread > 0 else np.ones_like(values)
    else:
        spread = values.std()
        scaled = (values - values.mean()) / spread if spread > 0 else np.zeros_like(values)
    return dict(zip(ranked, scaled.tolist(), strict=True))


def linear_fusion(
    runs: Sequence[Run],
    weights: Sequence[float] | None = None,
    normalisation: Normalisation = "minmax",
    depth: int = 1000,
) -> Run:
    """A weighted sum of each run's scores after normalising them per query (min-max to [0, 1], or
    z-scores). A document a run did not retrieve for a query takes that run's lowest normalised score
    for the query (0 under min-max), as pyserini's hybrid search does; a query's scores that are all
    equal normalise to 1 (min-max) or 0 (z-score)."""
    if normalisation not in ("minmax", "zscore"):
        raise SettingError(f"normalisation {normalisation!r}: use minmax or zscore")
    weights = _weights(runs, weights)
    queries = list(dict.fromkeys(query for run in runs for query in run))
    fused: Run = {}
    for query in queries:
        per_run = [_normalised(run[query], normalisation) if run.get(query) else {} for run in runs]
        documents = list(dict.fromkeys(doc for scores in per_run for doc in scores))
        floors = [
            min(scores.values(), default=0.0) if normalisation == "zscore" else 0.0 for scores in per_run
        ]
        fused[query] = _top(
            {
                doc: sum(w * scores.get(doc, floor)
                         for w, scores, floor in zip(weights, per_run, floors, strict=True))
                for doc in documents
            },
            depth,
        )  # fmt: skip
    return fused


def check_fusion_settings(method: str, k: int | None, normalisation: str | None) -> None:
    """Refuse an unknown method, or a setting of the other method (it would be silently ignored)."""
    if method not in ("rrf", "linear"):
        raise SettingError(f"method {method}: use rrf or linear")
    if method == "rrf" and normalisation is not None:
        raise SettingError("normalisation is for the linear method; rrf uses ranks, not scores")
    if method == "linear" and k is not None:
        raise SettingError("k is RRF's rank constant; the linear method has none")


def fuse_runs(
    runs: Sequence[Run],
    method: str = "rrf",
    weights: Sequence[float] | None = None,
    k: int | None = None,
    normalisation: str | None = None,
    depth: int = 1000,
) -> Run:
    """`runs` fused by `method`: rrf (rank constant `k`, 60 by default) or linear (`normalisation`,
    minmax by default); a setting of the other method is refused rather than ignored."""
    check_fusion_settings(method, k, normalisation)
    if method == "rrf":
        return reciprocal_rank_fusion(runs, 60 if k is None else k, weights, depth)
    return linear_fusion(runs, weights, normalisation or "minmax", depth)  # type: ignore[arg-type]
