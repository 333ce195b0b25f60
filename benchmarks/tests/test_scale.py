"""The scale benchmark's own parts: the generated collection, the per-child measurement, the exponents."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.scale import exponents, run_children
from benchmarks.scale_collection import TEST_QUERIES, TRAIN_QUERIES, generate_collection
from densekit.data import Dataset
from densekit.data.validate import validate_dataset
from tests.conftest import shared_collection


def test_the_generated_collection_is_valid_and_each_query_is_words_of_its_passage(tmp_path: Path):
    shared = shared_collection("scifact").parent
    root = generate_collection(tmp_path / "data", 3500, shared, seed=4)
    dataset = Dataset.open(root)
    report = validate_dataset(root)
    assert report.ok and report.documents == 3500 and report.problems == []
    texts = {document.id: document.text for document in dataset.iter_corpus()}
    assert len(texts) == 3500
    assert 55 <= sum(len(t.split()) for t in texts.values()) / len(texts) <= 65
    for split, count in (("test", TEST_QUERIES), ("train", TRAIN_QUERIES)):
        queries, qrels = dataset.split_queries(split)
        assert len(queries) == count and all(len(judged) == 1 for judged in qrels.values())
        for query_id, judged in qrels.items():
            (doc_id,) = judged
            assert set(queries[query_id].split()) <= set(texts[doc_id].split())
    again = generate_collection(tmp_path / "again", 3500, shared, seed=4)
    assert (again / "corpus.jsonl").read_bytes() == (root / "corpus.jsonl").read_bytes()
    assert (again / "queries.jsonl").read_bytes() == (root / "queries.jsonl").read_bytes()


def test_a_child_s_peak_memory_and_failure_are_its_own(tmp_path: Path):
    grow = "import numpy; a = numpy.ones(300 * 2**20 // 8); print('{\"inside\": 1}')"
    result = run_children([[sys.executable, "-c", grow]], tmp_path / "grow.log")
    assert result["status"] == "ok" and result["peak_rss_mib"] >= 300 and result["inside"] == {"inside": 1}
    small = run_children([[sys.executable, "-c", "pass"]], tmp_path / "small.log")
    assert small["peak_rss_mib"] < 100  # not the 300 MiB child's, nor this process's
    failed = run_children([[sys.executable, "-c", "raise SystemExit('no such file')"]], tmp_path / "f.log")
    assert failed["status"] == "failed" and failed["error"] == "no such file"


def test_exponents_are_the_log_log_slopes_of_the_stages_that_ran():
    runs = {
        str(n): {"passages": n, "stages": {
            "linear": {"status": "ok", "seconds": 2e-3 * n},
            "quadratic": {"status": "ok", "seconds": 1e-6 * n**2},
            "broke": {"status": "ok" if n < 1e5 else "failed", "seconds": 1.0},
        }}
        for n in (10_000, 100_000, 1_000_000)
    }  # fmt: skip
    slopes = exponents(runs, "stages", "seconds")
    assert slopes["linear"] == pytest.approx(1.0) and slopes["quadratic"] == pytest.approx(2.0)
    assert "broke" not in slopes  # one size is not a slope
    assert json.loads(json.dumps(slopes)) == slopes


def test_the_imported_vectors_are_unit_rows_and_the_encoder_s_own_for_judged_passages(tmp_path: Path):
    import numpy as np

    from benchmarks.scale_collection import make_encoder
    from benchmarks.scale_imported import judged_passages, write_vectors
    from densekit.encoding.embed import embed_texts
    from densekit.models import DenseEncoder

    data = generate_collection(tmp_path / "data", 3200, shared_collection("scifact").parent, seed=2)
    model = make_encoder(tmp_path / "model")
    vectors = np.load(write_vectors(data, model, tmp_path / "vectors.npy"))
    assert vectors.shape == (3200, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    documents = list(Dataset.open(data).iter_corpus())
    judged = judged_passages(data)
    rows = [row for row, document in enumerate(documents) if document.id in judged]
    assert len(judged) == TEST_QUERIES + TRAIN_QUERIES == len(rows)
    checked = sorted(np.random.default_rng(0).choice(rows, 300, replace=False))  # of the 3,000 judged
    expected = embed_texts(DenseEncoder.load(model), [documents[r].full_text for r in checked], "passage")
    assert np.allclose(vectors[checked], expected, atol=1e-5)
    others = np.setdiff1d(np.arange(3200), rows)
    assert np.abs(vectors[others] @ expected.mean(axis=0)).max() < 0.5  # random, not the encoder's
    assert not (tmp_path / "vectors.npy.partial").exists()
