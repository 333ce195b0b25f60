"""Turning raw top-k hits into a ranked run."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# query id -> [(doc id, score), ...] best first
RankedRun = dict[str, list[tuple[str, float]]]


def hits_to_run(
    query_ids: Sequence[str], scores: np.ndarray, doc_ids: np.ndarray, k: int, skip_self: bool = True
) -> RankedRun:
    """Best-first hits per query, at most `k`, without empty slots.

    With `skip_self`, a document whose id equals the query's is left out, as BEIR does (some
    collections hold queries that are also documents); ask the searcher for k+1 hits to still get k.
    """
    run: RankedRun = {}
    for row, query_id in enumerate(query_ids):
        ranked = []
        for doc_id, score in zip(doc_ids[row].tolist(), scores[row].tolist(), strict=True):
            if doc_id is None or (skip_self and doc_id == query_id):
                continue
            ranked.append((doc_id, score))
            if len(ranked) == k:
                break
        run[query_id] = ranked
    return run
