"""BM25 runs, and evaluation agreeing exactly with ir_measures."""

from __future__ import annotations

import json
from pathlib import Path

import ir_measures
import pytest

from densekit.data import Dataset, Diagnostics
from densekit.data.trec import read_qrels, read_run, write_run
from densekit.evaluation import evaluate, evaluate_per_query, parse_measures
from densekit.retrieval.bm25 import BM25Index

from .conftest import shared_collection


def test_bm25_ranks_the_matching_document_first(beir_dir: Path):
    dataset = Dataset.open(beir_dir)
    queries, _ = dataset.split_queries("test")
    run = BM25Index(dataset.iter_corpus(), show_progress=False).search(queries, k=3)
    assert next(iter(run["q2"])) == "d4"  # best first
    assert next(iter(run["q4"])) == "d5"
    assert "q3" not in run["q3"]  # the query's own id is skipped
    assert all(len(ranked) == 3 for ranked in run.values())


def test_evaluate_matches_ir_measures_on_the_same_files(beir_dir: Path, tmp_path: Path):
    dataset = Dataset.open(beir_dir)
    queries, _ = dataset.split_queries("test")
    write_run(tmp_path / "run.trec", BM25Index(dataset.iter_corpus(), show_progress=False).search(queries, 5))
    qrels_trec = tmp_path / "qrels.trec"
    qrels_trec.write_text(
        "".join(f"{q} 0 {d} {r}\n" for q, docs in dataset.qrels("test").items() for d, r in docs.items())
    )
    names = ["nDCG@10", "RR@10", "R@100", "R@1000", "AP", "P@1"]
    ours = evaluate(
        read_qrels(qrels_trec, Diagnostics()), read_run(tmp_path / "run.trec", Diagnostics()), names
    )
    theirs = ir_measures.calc_aggregate(
        parse_measures(names),
        ir_measures.read_trec_qrels(str(qrels_trec)),
        ir_measures.read_trec_run(str(tmp_path / "run.trec")),
    )
    assert ours == {str(m): v for m, v in theirs.items()}


def test_per_query_values_average_to_the_aggregate():
    qrels = {"a": {"d1": 1}, "b": {"d2": 1}}
    run = {"a": {"d1": 2.0, "d2": 1.0}, "b": {"d1": 2.0, "d2": 1.0}}
    rows = evaluate_per_query(qrels, run, ["RR@10"])
    assert sorted(rows) == [("a", "RR@10", 1.0), ("b", "RR@10", 0.5)]
    assert evaluate(qrels, run, ["RR@10"]) == {"RR@10": 0.75}


def test_unknown_measure_is_named():
    with pytest.raises(ValueError, match="unknown measure 'nDGC@10'"):
        parse_measures(["nDGC@10"])


def test_scifact_bm25_reproduces_pyserini(tmp_path: Path):
    """SciFact test, BM25 (k1=0.9, b=0.4, stemmed, stop words, title + text): pyserini reports 0.679."""
    dataset = Dataset.open(shared_collection("scifact"))
    queries, qrels = dataset.split_queries("test")
    run = BM25Index(dataset.iter_corpus(), show_progress=False).search(queries, k=1000)
    scores = evaluate(qrels, run)
    assert abs(scores["nDCG@10"] - 0.679) <= 0.01
    assert json.loads(json.dumps(scores)) == scores
