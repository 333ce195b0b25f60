"""BM25 runs, and evaluation giving the measures as their definitions do."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from densekit.data import Dataset, Diagnostics
from densekit.data.trec import read_qrels, read_run
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


def ranked_lists(run_file: Path) -> dict[str, list[str]]:
    """Each query's documents from a TREC run file, best first, ties broken as trec_eval does (by
    document id, descending)."""
    scored: dict[str, list[tuple[float, str]]] = {}
    for line in run_file.read_text().splitlines():
        query, _, doc, _, score, _ = line.split()
        scored.setdefault(query, []).append((float(score), doc))
    return {q: [doc for _, doc in sorted(pairs, reverse=True)] for q, pairs in scored.items()}


def reference_scores(qrels: dict[str, dict[str, int]], ranked: dict[str, list[str]]) -> dict[str, float]:
    """nDCG@10 (gain = relevance, discount log2(rank + 1), as trec_eval), RR@10, R@10, R@100, AP and
    P@1 from their definitions, averaged over the judged queries; one absent from the run scores 0."""

    def per_query(judged: dict[str, int], docs: list[str]) -> dict[str, float]:
        hits = [judged.get(doc, 0) > 0 for doc in docs]
        relevant = sum(r > 0 for r in judged.values())
        dcg = sum(judged.get(doc, 0) / math.log2(rank + 2) for rank, doc in enumerate(docs[:10]))
        ideal = sorted((r for r in judged.values() if r > 0), reverse=True)[:10]
        idcg = sum(r / math.log2(rank + 2) for rank, r in enumerate(ideal))
        first = next((rank for rank, hit in enumerate(hits[:10]) if hit), None)
        precisions = [sum(hits[: rank + 1]) / (rank + 1) for rank, hit in enumerate(hits) if hit]
        return {
            "nDCG@10": dcg / idcg,
            "RR@10": 0.0 if first is None else 1 / (first + 1),
            "R@10": sum(hits[:10]) / relevant,
            "R@100": sum(hits[:100]) / relevant,
            "AP": sum(precisions) / relevant,
            "P@1": float(sum(hits[:1])),
        }

    values = [per_query(judged, ranked.get(query, [])) for query, judged in qrels.items()]
    return {name: sum(v[name] for v in values) / len(values) for name in values[0]}


MEASURES = ["nDCG@10", "RR@10", "R@10", "R@100", "AP", "P@1"]


def test_evaluate_gives_the_measures_as_defined(tmp_path: Path):
    qrels_file = tmp_path / "qrels.tsv"
    qrels_file.write_text(
        "query-id\tcorpus-id\tscore\n"
        "q1\td1\t2\nq1\td2\t1\nq1\td3\t0\nq1\td7\t1\n"  # d3 judged, not relevant
        "q2\td4\t1\n"
        "q3\td5\t2\nq3\td6\t1\n"
        "q4\td9\t1\n"  # q4 is not in the run: it counts as 0
    )
    q1 = ["d3", "d1", "x1", "d2", "x2", "x3", "x4", "x5", "x6", "x7", "d7"]  # d7 11th, beyond the cut of 10
    run = {"q1": q1, "q2": ["x1", "x2", "d4"], "q3": ["d6", "d5"], "q5": ["d1"]}  # q5 has no judgements
    run_file = tmp_path / "run.trec"
    run_file.write_text(
        "".join(f"{q} Q0 {d} {r + 1} {20 - r}.5 t\n" for q, docs in run.items() for r, d in enumerate(docs))
    )
    log2 = math.log2
    by_hand = {
        "nDCG@10": (
            (2 / log2(3) + 1 / log2(5)) / (2 / log2(2) + 1 / log2(3) + 1 / log2(4))  # q1
            + 1 / log2(4)  # q2: its one relevant document third, ideally first
            + (1 / log2(2) + 2 / log2(3)) / (2 / log2(2) + 1 / log2(3))  # q3: the two swapped
        )
        / 4,
        "RR@10": (1 / 2 + 1 / 3 + 1) / 4,
        "R@10": (2 / 3 + 1 + 1) / 4,
        "R@100": (3 / 3 + 1 + 1) / 4,
        "AP": ((1 / 2 + 2 / 4 + 3 / 11) / 3 + 1 / 3 + (1 / 1 + 2 / 2) / 2) / 4,
        "P@1": (0 + 0 + 1 + 0) / 4,
    }
    qrels = read_qrels(qrels_file, Diagnostics())
    assert reference_scores(qrels, ranked_lists(run_file)) == pytest.approx(by_hand, abs=1e-12)
    scores = evaluate(qrels, read_run(run_file, Diagnostics()), MEASURES)
    assert list(scores) == MEASURES
    assert scores == pytest.approx(by_hand, abs=1e-9)


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
