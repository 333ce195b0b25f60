"""BM25: queries with no term of the corpus, scores of given documents, one progress style."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from densekit.data import Dataset
from densekit.mining.filters import MiningSettings
from densekit.mining.mine import mine
from densekit.retrieval.bm25 import BM25Config, BM25Index

from .conftest import QUERIES


@pytest.fixture
def odd_queries(make_beir) -> Path:
    """The small collection with queries BM25 cannot match: punctuation only after tokenizing and
    stop words (`M&M's`), and a word no document has."""
    queries = [*QUERIES, {"_id": "q5", "text": "M&M's"}, {"_id": "q6", "text": "artichokes"}]
    qrels = {"test": [("q1", "d1", 1), ("q5", "d3", 1), ("q6", "d2", 1)], "train": [("q2", "d4", 1)]}
    return make_beir(queries=queries, qrels=qrels)


def test_a_query_with_no_term_of_the_corpus_gets_no_results_and_is_named(odd_queries: Path, caplog):
    dataset = Dataset.open(odd_queries)
    queries, _ = dataset.split_queries("test")
    index = BM25Index(dataset.iter_corpus(), show_progress=False)
    run = index.search(queries, k=3)
    assert run["q5"] == {} and run["q6"] == {}
    assert list(run) == ["q1", "q5", "q6"]  # every query keeps its place
    assert next(iter(run["q1"])) in {"d1", "d2"} and len(run["q1"]) == 3
    assert index.queries_without_terms == ["q5", "q6"]
    assert "2 queries have no term of the corpus" in caplog.text and 'q5 ("M&M\'s")' in caplog.text
    assert index.scores_of("M&M's", ["d1", "d3"]) == [0.0, 0.0]
    assert index.scores_of("cats", ["d1", "d3"])[0] > 0


def test_mining_reports_the_queries_bm25_cannot_match(odd_queries: Path, tmp_path: Path):
    settings = MiningSettings(first_rank=1, last_rank=5, count=2)
    dataset = Dataset.open(odd_queries)
    report = mine(dataset, "test", tmp_path / "m.jsonl", "bm25", settings, show_progress=False)
    assert report["queries_without_terms"] == ["q5", "q6"]
    assert set(report["examples_of_short_queries"]) >= {"q5", "q6"}
    saved = json.loads((tmp_path / "m.jsonl.report.json").read_text())
    assert saved["queries_without_terms"] == ["q5", "q6"]


def test_one_progress_style_and_none_when_not_asked(beir_dir: Path, capfd):
    dataset = Dataset.open(beir_dir)
    queries, _ = dataset.split_queries("test")
    BM25Index(dataset.iter_corpus(), show_progress=False).search(queries, k=2)
    printed = capfd.readouterr()
    assert printed.err == "" and printed.out == ""
    BM25Index(dataset.iter_corpus(), show_progress=True).search(queries, k=2)
    printed = capfd.readouterr().err
    assert "BM25 indexing" in printed and "BM25 search" in printed  # densekit's own bars
    assert not any(bar in printed for bar in ("Split strings", "Stem Tokens", "BM25S", "it/s]"))  # bm25s's


@pytest.mark.parametrize(("field", "value"), [("k1", -1.0), ("b", 5.0), ("b", -0.1)])
def test_out_of_range_parameters_are_refused(field: str, value: float):
    with pytest.raises(ValueError, match=field):
        BM25Config(**{field: value})


def test_an_index_built_in_chunks_scores_as_one_built_whole(beir_dir: Path, monkeypatch):
    """Terms are numbered over the whole corpus, not per chunk: an index fed two documents at a time
    ranks and scores every query exactly as one fed the corpus at once."""
    dataset = Dataset.open(beir_dir)
    queries = {**dataset.queries(), "all": "domesticated mammals programming language energy"}
    whole = BM25Index(dataset.iter_corpus(), show_progress=False)
    monkeypatch.setattr("densekit.retrieval.bm25._INDEX_CHUNK", 2)
    chunked = BM25Index(dataset.iter_corpus(), show_progress=False, total=dataset.count_documents())
    assert chunked.search(queries, k=5) == whole.search(queries, k=5)
    ids = list(whole.ids)
    assert list(chunked.ids) == ids and len(ids) > 2
    for query in queries.values():
        assert chunked.scores_of(query, ids) == whole.scores_of(query, ids)


@pytest.mark.parametrize("enabled", [True, False])
def test_indexing_leaves_the_garbage_collector_as_it_found_it_even_on_bad_input(
    beir_dir: Path, enabled: bool
):
    """The cyclic collector is paused while an index is built (no cycles form there) and restored after,
    whether the build ends or fails."""

    def failing():
        yield from Dataset.open(beir_dir).iter_corpus()
        raise ValueError("a bad line")

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        BM25Index(Dataset.open(beir_dir).iter_corpus(), show_progress=False)
        assert gc.isenabled() is enabled
        with pytest.raises(ValueError, match="a bad line"):
            BM25Index(failing(), show_progress=False)
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()
