"""Exact search of a flat index in blocks (`index.exact_search`): the rows a brute-force ranking gives,
equal scores in row order, across blocks of rows and of queries, and what a flat `FaissIndex` returns
whether loaded whole or memory-mapped."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from densekit.index import IndexSpec, SearchIndex, build_index, exact_search
from densekit.index.exact_search import exact_top_k

from .processes import run_in_processes
from .test_index import fake_store


def integer_vectors(rows: int, dimension: int, seed: int) -> np.ndarray:
    """Small whole numbers, whose inner products float32 computes exactly (so ties are real ties)."""
    return np.random.default_rng(seed).integers(-3, 4, size=(rows, dimension)).astype(np.float32)


def brute_force(vectors: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Every score in float64, rows ranked by score, highest first, then by row."""
    scores = queries.astype(np.float64) @ vectors.astype(np.float64).T
    order = np.lexsort((np.broadcast_to(np.arange(len(vectors)), scores.shape), -scores))[:, :k]
    return np.take_along_axis(scores, order, axis=1), order


@pytest.mark.parametrize(("block_rows", "most_scores"), [(1 << 16, 1 << 24), (7, 40), (64, 3)])
def test_the_top_rows_are_a_brute_force_ranking_in_any_blocks(monkeypatch, block_rows: int, most_scores: int):
    # 300 rows of 6 whole-number dimensions: many scores tie, so the row order among equals shows too
    vectors, queries = integer_vectors(300, 6, 0), integer_vectors(23, 6, 1)
    monkeypatch.setattr(exact_search, "BLOCK_ROWS", block_rows)
    monkeypatch.setattr(exact_search, "MOST_SCORES", most_scores)
    expected_scores, expected_rows = brute_force(vectors, queries, 300)
    for k in (1, 5, 300):
        scores, rows = exact_top_k(vectors, queries, k)
        assert scores.dtype == np.float32 and rows.dtype == np.int64 and rows.shape == (23, k)
        assert np.array_equal(scores, expected_scores[:, :k].astype(np.float32))
        for query in range(len(queries)):
            # above the k-th score the ranking is fixed; rows tied at it may be any of the tied, in row order
            above = expected_scores[query, :k] > expected_scores[query, k - 1]
            assert np.array_equal(rows[query, above], expected_rows[query, :k][above])
            tied = rows[query, ~above]
            assert np.all(np.diff(tied) > 0)
            assert np.array_equal(queries[query] @ vectors[tied].T, np.full(len(tied), scores[query, -1]))


def test_a_lone_query_gets_the_ranking_it_gets_among_others():
    # one query a call is searched by faiss's brute force, more by torch's product: the same rows, ties
    # in row order, and (whole-number vectors) the same scores
    vectors, queries = integer_vectors(300, 6, 0), integer_vectors(23, 6, 1)
    for k in (1, 5, 300):
        batch_scores, batch_rows = exact_top_k(vectors, queries, k)
        for query in range(len(queries)):
            scores, rows = exact_top_k(vectors, queries[query : query + 1], k)
            assert scores.dtype == np.float32 and rows.dtype == np.int64 and rows.shape == (1, k)
            assert np.array_equal(scores[0], batch_scores[query])
            above = batch_scores[query] > batch_scores[query, -1]
            assert np.array_equal(rows[0, above], batch_rows[query, above])
            tied = rows[0, ~above]
            assert np.all(np.diff(tied) > 0)


def test_equal_rows_come_in_row_order_across_blocks(monkeypatch):
    # one vector copied into rows 3, 10 and 17 (three blocks of 7), and the best match of the query
    vectors = -np.abs(integer_vectors(21, 4, 2))
    vectors[[3, 10, 17]] = [1, 1, 1, 1]
    monkeypatch.setattr(exact_search, "BLOCK_ROWS", 7)
    scores, rows = exact_top_k(vectors, np.full((1, 4), 2.0, dtype=np.float32), 3)
    assert rows.tolist() == [[3, 10, 17]] and scores.tolist() == [[8.0, 8.0, 8.0]]


def test_no_queries_or_read_only_ones_are_searched_as_faiss_would():
    vectors, queries = integer_vectors(21, 4, 0), integer_vectors(3, 4, 1)
    scores, rows = exact_top_k(vectors, queries[:0], 5)
    assert scores.shape == rows.shape == (0, 5)
    expected = exact_top_k(vectors, queries, 5)
    queries.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns of a read-only array it was handed
        found = exact_top_k(vectors, queries, 5)
    assert all(np.array_equal(a, b) for a, b in zip(found, expected, strict=True))


def search_read_only_rows(rank: int) -> None:
    """In a fresh process (torch warns of a read-only array once a process): a memory-mapped index's
    read-only rows are searched as writable ones are, without a warning."""
    vectors, queries = integer_vectors(21, 4, 0), integer_vectors(3, 4, 1)
    expected = exact_top_k(vectors, queries, 5)
    vectors.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = exact_top_k(vectors, queries, 5)
    assert all(np.array_equal(a, b) for a, b in zip(found, expected, strict=True))


def test_read_only_rows_are_searched_without_a_warning():
    run_in_processes(search_read_only_rows, (), count=1)


@pytest.mark.parametrize("k", [0, 22])
def test_k_outside_the_rows_held_is_refused(k: int):
    with pytest.raises(ValueError, match=f"k={k}: between 1 and the 21 rows held"):
        exact_top_k(integer_vectors(21, 4, 0), integer_vectors(1, 4, 1), k)


@pytest.mark.parametrize("mmap", [False, True])
def test_a_flat_index_returns_the_brute_force_ranking_loaded_or_mapped(tmp_path: Path, mmap: bool):
    vectors = integer_vectors(500, 8, 3)
    store = fake_store(tmp_path / "emb", vectors, parts=2)
    build_index(store, IndexSpec(type="flat"), tmp_path / "index", show_progress=False)
    index = SearchIndex.load(tmp_path / "index", mmap=mmap)
    queries = integer_vectors(9, 8, 4)
    expected_scores, expected_rows = brute_force(vectors, queries, 500)
    for some in (queries, queries[:1]):  # a lone query is searched another way
        hits = index.search(some, 500)
        ranked = expected_rows[: len(some)]
        assert hits.doc_ids().tolist() == [[f"doc{row}" for row in rows] for rows in ranked]
        assert np.array_equal(hits.scores, expected_scores[: len(some)].astype(np.float32))
