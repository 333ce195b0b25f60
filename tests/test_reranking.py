"""The cross-encoder and reranking a run with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from densekit.cli.main import app
from densekit.data.dataset import Dataset
from densekit.data.trec import read_run, write_run
from densekit.diagnostics import Diagnostics
from densekit.models.cross_encoder import CrossEncoder
from densekit.retrieval.rerank import merge_reranked, rerank_run

from .conftest import CORPUS, QUERIES
from .test_outputs import cli

PAIRS = [(QUERIES[0]["text"], CORPUS[0]["text"]), (QUERIES[1]["text"], CORPUS[3]["text"] * 3),
         ("short", "x"), (QUERIES[2]["text"], CORPUS[6]["text"])]  # fmt: skip


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """The tiny BERT with a new one-score head, saved as a cross-encoder folder."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ce") / "model"
    CrossEncoder.load(tiny_model).save(path)
    return path


def test_a_saved_cross_encoder_loads_in_sentence_transformers_with_equal_scores(cross_encoder: Path):
    from sentence_transformers import CrossEncoder as STCrossEncoder

    ours = CrossEncoder.load(cross_encoder).score(PAIRS, batch_size=2)
    theirs = STCrossEncoder(str(cross_encoder), device="cpu").predict(
        PAIRS, activation_fn=torch.nn.Identity()
    )
    assert np.abs(ours - np.asarray(theirs)).max() < 1e-5
    assert np.ptp(ours) > 1e-4  # distinct scores: a real comparison


def test_scores_do_not_depend_on_batching(cross_encoder: Path):
    model = CrossEncoder.load(cross_encoder)
    together = model.score(PAIRS, batch_size=3)
    alone = np.array([model.score([pair])[0] for pair in PAIRS])
    assert np.abs(together - alone).max() < 1e-5


def test_merge_reranked_orders_the_top_by_the_new_scores_ties_by_the_run_and_keeps_the_rest():
    merged = merge_reranked(["a", "b", "c", "d", "e"], [0.2, 0.9, 0.2])
    assert list(merged) == ["b", "a", "c", "d", "e"]  # a and c tie: a came first in the run
    assert merged["b"] == 0.9 and merged["d"] > merged["e"] and merged["d"] < 0.2


def _first_run(beir_dir: Path) -> dict:
    queries, _ = Dataset.open(beir_dir).split_queries("test")
    ids = [d["_id"] for d in CORPUS]
    return {q: {doc: float(len(ids) - i) for i, doc in enumerate(ids)} for q in queries}


def test_reranking_at_depth_1_leaves_the_run_unchanged(beir_dir: Path, cross_encoder: Path, tmp_path: Path):
    write_run(tmp_path / "first.trec", _first_run(beir_dir))
    args = ["rerank", str(cross_encoder), str(tmp_path / "first.trec"), str(beir_dir),
            "-o", str(tmp_path / "r.trec"), "--depth", "1", "--no-progress", "--device", "cpu"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    first, again = (
        read_run(tmp_path / "first.trec", Diagnostics()),
        read_run(tmp_path / "r.trec", Diagnostics()),
    )
    assert {q: list(d) for q, d in again.items()} == {q: list(d) for q, d in first.items()}


def test_reranking_orders_the_top_by_the_cross_encoders_scores(beir_dir: Path, cross_encoder: Path):
    dataset = Dataset.open(beir_dir)
    queries, _ = dataset.split_queries("test")
    model = CrossEncoder.load(cross_encoder)
    first = _first_run(beir_dir)
    reranked = rerank_run(model, first, queries, dataset.iter_corpus(), depth=5, show_progress=False)
    texts = {d.id: d.full_text for d in dataset.iter_corpus()}
    for query, documents in reranked.items():
        top = list(first[query])[:5]
        own = model.score([(queries[query], texts[doc]) for doc in top])
        assert list(documents)[:5] == [top[i] for i in np.argsort(-own, kind="stable")]
        assert list(documents)[5:] == list(first[query])[5:]
        assert [documents[d] for d in top] == pytest.approx(own.tolist(), abs=1e-5)


def test_reranking_scores_at_the_precision_it_is_given_and_refuses_fp16_on_a_cpu(
    beir_dir: Path, cross_encoder: Path, tmp_path: Path, capsys
):
    write_run(tmp_path / "first.trec", _first_run(beir_dir))
    common = [str(tmp_path / "first.trec"), str(beir_dir), "--depth", "5", "--no-progress", "--device", "cpu"]
    runs = {}
    for precision in ("float32", "bf16"):
        output = tmp_path / f"{precision}.trec"
        args = ["rerank", str(cross_encoder), *common, "-o", str(output), "--precision", precision]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        runs[precision] = read_run(output, Diagnostics())
    dataset = Dataset.open(beir_dir)
    queries, _ = dataset.split_queries("test")
    texts = {d.id: d.full_text for d in dataset.iter_corpus()}
    model = CrossEncoder.load(cross_encoder)
    for query, documents in runs["bf16"].items():
        top = list(_first_run(beir_dir)[query])[:5]
        pairs = [(queries[query], texts[doc]) for doc in top]
        bf16, float32 = model.score(pairs, precision="bf16"), model.score(pairs)
        assert [documents[d] for d in top] == pytest.approx(bf16.tolist(), abs=1e-6)
        assert [runs["float32"][query][d] for d in top] == pytest.approx(float32.tolist(), abs=1e-6)
        assert np.abs(bf16 - float32).max() > 1e-6  # bf16 was used: its scores are not float32's
        assert np.abs(bf16 - float32).max() < 0.05
    code, err, _ = cli(capsys, "rerank", str(cross_encoder), *common, "-o", str(tmp_path / "f.trec"),
                       "--precision", "fp16")  # fmt: skip
    assert code == 2 and "fp16 needs a GPU" in err
    assert not (tmp_path / "f.trec").exists()
