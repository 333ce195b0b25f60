"""Mining: each filter does what it says, and `densekit mine` writes examples with a report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from densekit.cli import app
from densekit.data.examples import TrainingExample, read_examples
from densekit.mining.filters import MiningSettings, choose_negatives

from .training_fixtures import write_training_collection

EXAMPLE = TrainingExample(query_id="q", query="query", positives=["pos"])
TEXTS = {
    "pos": "The Positive text",
    **{f"d{i}": f"document {i}" for i in range(10)},
    "twin": "the positive   TEXT",
}


def ranked(*pairs: tuple[str, float]) -> dict:
    return {"q": dict(pairs)}


def mine_one(candidates: dict, **settings) -> tuple[list[str], object]:
    mined, report = choose_negatives(
        [EXAMPLE], candidates, {"q": {"pos": 10.0}}, TEXTS, MiningSettings(**settings)
    )
    return mined[0].negatives, report


def test_rank_range_is_one_based_and_inclusive():
    candidates = ranked(*[(f"d{i}", 9.0 - i) for i in range(10)])
    negatives, report = mine_one(candidates, first_rank=3, last_rank=5, count=10)
    assert negatives == ["d2", "d3", "d4"] and report.candidates == 3


def test_positives_and_identical_texts_are_removed():
    candidates = ranked(("pos", 11.0), ("twin", 10.5), ("d1", 5.0))
    negatives, report = mine_one(candidates, first_rank=1, last_rank=3)
    assert negatives == ["d1"]
    assert (report.removed_positive, report.removed_identical_text) == (1, 1)
    kept, _ = mine_one(candidates, first_rank=1, last_rank=3, exclude_identical=False)
    assert kept == ["twin", "d1"]


def test_absolute_margin_drops_candidates_close_to_the_positive():
    candidates = ranked(("d1", 9.5), ("d2", 9.0), ("d3", 8.9))
    negatives, report = mine_one(candidates, first_rank=1, last_rank=3, margin=1.0)
    assert negatives == ["d2", "d3"] and report.removed_margin == 1  # only d1 scores above 10 - 1


def test_margins_compare_with_the_lowest_positive():
    example = TrainingExample(query_id="q", query="q", positives=["pos", "d9"])
    candidates = ranked(("d1", 7.5), ("d2", 5.9), ("d3", 5.0))
    scores = {"q": {"pos": 10.0, "d9": 6.0}}
    mined, report = choose_negatives(
        [example], candidates, scores, TEXTS, MiningSettings(first_rank=1, relative_margin=0.95)
    )
    assert mined[0].negatives == ["d3"]  # above 6.0 x 0.95 = 5.7: d1 and d2 out
    assert report.removed_margin == 2


def test_sampling_is_seeded_and_reports_short_queries():
    candidates = ranked(*[(f"d{i}", 1.0) for i in range(10)])
    first, _ = mine_one(candidates, first_rank=1, count=4, seed=1)
    again, _ = mine_one(candidates, first_rank=1, count=4, seed=1)
    other, _ = mine_one(candidates, first_rank=1, count=4, seed=2)
    assert first == again != other and len(first) == 4
    assert first == sorted(first, key=lambda d: int(d[1:]))  # kept in rank order
    _, report = mine_one(ranked(("d1", 1.0)), first_rank=1, count=4)
    assert report.short_queries == ["q"]


def test_mine_command_bm25_and_dense(tmp_path: Path, tiny_st_model: Path):
    root, _ = write_training_collection(tmp_path / "data")
    runner = CliRunner()
    out = tmp_path / "bm25.jsonl"
    result = runner.invoke(
        app,
        ["mine", str(root), "-o", str(out), "--ranks", "2-20", "--count", "5", "--no-progress"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    examples = read_examples(out)
    assert len(examples) == 12
    assert all(not set(e.negatives) & set(e.positives) and len(e.negatives) == 5 for e in examples)
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["source"] == "bm25" and report["negatives_written"] == 60

    dense = tmp_path / "dense.jsonl"
    result = runner.invoke(
        app,
        ["mine", str(root), "-o", str(dense), "--source", "dense", "--model", str(tiny_st_model),
         "--ranks", "1-10", "--count", "3", "--relative-margin", "0.99", "--no-progress", "--device", "cpu"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(Path(f"{dense}.report.json").read_text())
    assert report["source"] == "dense" and report["removed_positive"] >= 1
    assert all(not set(e.negatives) & set(e.positives) for e in read_examples(dense))


def test_relative_margin_keeps_its_meaning_for_negative_scores():
    """Inner products of unnormalised vectors can be negative; the bar must stay below the positive."""
    candidates = ranked(("d1", -0.4), ("d2", -0.51), ("d3", -0.6))
    example = TrainingExample(query_id="q", query="query", positives=["pos"])
    mined, report = choose_negatives(
        [example], candidates, {"q": {"pos": -0.5}}, TEXTS, MiningSettings(first_rank=1, relative_margin=0.95)
    )
    assert mined[0].negatives == ["d3"]  # bar -0.525: d1 (above the positive) and d2 out
    assert report.removed_margin == 2


def test_dense_mining_takes_positives_from_a_flat_index_with_the_scores_encoding_gives(
    tmp_path: Path, tiny_st_model: Path
):
    from densekit.data import Dataset
    from densekit.index import FaissIndex, IndexSpec
    from densekit.mining.mine import dense_candidates
    from densekit.models import DenseEncoder
    from densekit.retrieval.memory_index import index_corpus

    root, train = write_training_collection(tmp_path / "data")
    encoder = DenseEncoder.load(tiny_st_model).eval()
    documents = list(Dataset.open(root).iter_corpus())
    texts = {doc.id: doc.full_text for doc in documents}
    examples = read_examples(train)
    flat = index_corpus(encoder, documents, show_progress=False)
    ids = [doc.id for doc in documents]
    assert np.array_equal(flat.stored_vectors(ids[::-1]), flat.index.reconstruct_n(0, len(ids))[::-1])
    hnsw = FaissIndex.from_vectors(flat.index.reconstruct_n(0, len(ids)), ids, IndexSpec(type="hnsw"))
    assert hnsw.stored_vectors(ids) is None  # HNSW keeps a graph: its positives are encoded
    from_index = dense_candidates(encoder, flat, texts, examples, 5, show_progress=False)[1]
    encoded = dense_candidates(encoder, hnsw, texts, examples, 5, show_progress=False)[1]
    assert from_index.keys() == encoded.keys()
    for query_id, scores in encoded.items():
        assert scores.keys() == from_index[query_id].keys()
        np.testing.assert_allclose(list(from_index[query_id].values()), list(scores.values()), atol=1e-5)
