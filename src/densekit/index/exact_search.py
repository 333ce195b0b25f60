"""Exact search by inner product over a flat index's vectors, as matrix products and top-k selection in
torch, a block of rows at a time.

By hand because faiss 1.15.1's flat search of a few queries at a time is slow on a CPU: the service's
batches of 16 queries against SciFact's 5,183 vectors took 0.30 ms of CPU a query on one thread where
torch's product and top-k took 0.07 (`benchmarks/search_qps.py`), about 5% of what a query costs the
service. The rows are faiss's own store, read in place (memory-mapped where the index is).

One query a call goes to faiss's own brute-force search instead: it fuses the products and the top-k
selection in one pass over the rows, where torch's product and top-k make two, and it took 0.3-0.8 of
torch's time for a lone query at 5,183, 100,000 and 1,000,000 rows (k 10 and 1,000, one thread); from
a few queries a call on, torch's matrix product wins (0.4-0.6 of faiss's time at 16 a call).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

from densekit.errors import InputError

if TYPE_CHECKING:
    import torch

# Rows of the collection scored at once, and the most scores held at once (64 MiB of float32): a block
# of queries against a block of rows, so that memory stays bounded at any collection and query count.
BLOCK_ROWS = 1 << 16
MOST_SCORES = 1 << 24


def exact_top_k(vectors: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The `k` rows of `vectors` (rows, dimension) with the highest inner product with each of
    `queries` (count, dimension), best first and rows of equal score in row order: (scores, rows), each
    (count, k) as faiss returns them (float32, int64). Which of several rows tied at the `k`th score
    are kept is not set (nor is it in faiss). `k` must not pass the rows held."""
    rows = len(vectors)
    if not 1 <= k <= rows:
        raise InputError(f"k={k}: between 1 and the {rows} rows held")
    if not len(queries):
        return np.empty((0, k), dtype=np.float32), np.empty((0, k), dtype=np.int64)
    queries = np.require(queries, np.float32, ("C", "W"))  # torch takes only writable arrays in place
    if len(queries) == 1:
        import faiss

        scores, labels = faiss.knn(queries, vectors, k, faiss.METRIC_INNER_PRODUCT)
        return _ties_in_row_order(scores, labels)
    block_rows = min(rows, BLOCK_ROWS)
    block_queries = max(1, MOST_SCORES // block_rows)
    import torch  # here, not above: the command line checks its arguments before torch loads

    with warnings.catch_warnings():
        # A memory-mapped index's rows are read-only, and copying them to be writable would double a
        # million-row index's memory; the table is only ever read here, so torch's warning does not apply.
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        table = torch.from_numpy(vectors)
    found = [
        _top_k_of_blocks(table, torch.from_numpy(queries[first : first + block_queries]), k, block_rows)
        for first in range(0, len(queries), block_queries)
    ]
    scores, labels = (torch.cat(parts).numpy() for parts in zip(*found, strict=True))
    return _ties_in_row_order(scores, labels)


def _top_k_of_blocks(
    table: torch.Tensor, queries: torch.Tensor, k: int, block_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`exact_top_k` of a block of queries, sorted by score: each block of rows' best `k`, merged into
    the best so far. A query's scores may differ in the last float32 bit with the batch it comes in (the
    BLAS sums in another order for another number of queries), as faiss's did past 20 queries a call."""
    import torch

    best_scores = best_rows = None
    for start in range(0, len(table), block_rows):
        block = table[start : start + block_rows]
        top = torch.topk(queries @ block.T, min(k, len(block)), dim=1)
        scores, rows = top.values, top.indices + start
        if best_scores is not None:  # merged as it goes, so that at most 2k a query are held
            scores, rows = torch.cat([best_scores, scores], dim=1), torch.cat([best_rows, rows], dim=1)
            top = torch.topk(scores, min(k, scores.shape[1]), dim=1)
            scores, rows = top.values, torch.gather(rows, 1, top.indices)
        best_scores, best_rows = scores, rows
    return best_scores, best_rows


def _ties_in_row_order(scores: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each query's results, sorted by score already, with rows of equal score in row order (topk
    leaves them in none); only queries with a tie are sorted again (a sort of every query's k results
    took longer than faiss's whole search at k=1000)."""
    tied = np.flatnonzero((scores[:, 1:] == scores[:, :-1]).any(axis=1))
    if len(tied):
        order = np.lexsort((rows[tied], -scores[tied]))
        scores[tied] = np.take_along_axis(scores[tied], order, axis=1)
        rows[tied] = np.take_along_axis(rows[tied], order, axis=1)
    return scores, rows
