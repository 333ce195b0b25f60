"""The quickstart: never another collection's embeddings, and published figures only beside their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from densekit.data import Dataset
from densekit.evaluation.encoder_evaluation import evaluate_encoder
from densekit.io.outputs import OutputError
from densekit.models import DenseEncoder
from densekit.quickstart import KNOWN_COLLECTIONS, collection_digest, run_quickstart

from .conftest import shared_collection
from .test_outputs import cli


def fresh_ndcg(model: Path | str, data: Path) -> float:
    """nDCG@10 of `model` on `data`, computed from scratch in memory."""
    dataset = Dataset.open(data)
    queries, qrels = dataset.split_queries("test")
    encoder = DenseEncoder.load(model)
    return evaluate_encoder(encoder, dataset.iter_corpus(), queries, qrels, ["nDCG@10"])["nDCG@10"]


@pytest.fixture
def two_collections(make_beir, beir_dir: Path) -> tuple[Path, Path]:
    """Two collections with the same corpus and queries; the second judges other documents."""
    other = make_beir(qrels={"test": [("q1", "d6", 1), ("q2", "d3", 1), ("q4", "d8", 1)]})
    return beir_dir, other


def test_another_collection_never_reuses_the_first_ones_results(
    tiny_st_model: Path, two_collections: tuple[Path, Path], tmp_path: Path
):
    first, second = two_collections
    out, model = tmp_path / "quickstart", str(tiny_st_model)
    result = run_quickstart(first, out, device="cpu", show_progress=False, model=model)
    assert result.metrics["model"]["nDCG@10"] == pytest.approx(fresh_ndcg(model, first))
    with pytest.raises(OutputError, match=r"holds quickstart run made from other settings or inputs "
                                          r"\(differs in: data\)"):  # fmt: skip
        run_quickstart(second, out, device="cpu", show_progress=False, model=model)
    result = run_quickstart(second, out, device="cpu", show_progress=False, model=model, overwrite=True)
    assert result.metrics["model"]["nDCG@10"] == pytest.approx(fresh_ndcg(model, second))
    assert fresh_ndcg(model, second) != pytest.approx(fresh_ndcg(model, first))
    assert result.collection == "custom" and result.published == {}


def test_the_default_output_is_per_collection_and_the_table_names_it(
    capsys, two_collections: tuple[Path, Path], tmp_path: Path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    first, second = two_collections
    for data, queries in ((first, 4), (second, 3)):
        code, err, out = cli(capsys, "quickstart", "--data", data, "--device", "cpu", "--no-progress")
        assert code == 0, err
        assert f"{data.name} test ({queries} queries) -> quickstart-output/{data.name}/metrics.json" in out
        assert "SciFact test" not in out and "0.645" not in out and "0.679" not in out
        assert f"no published figures for {data.name}" in out
    for data in (first, second):
        metrics = (tmp_path / "quickstart-output" / data.name / "metrics.json").read_text()
        assert f'"nDCG@10": {fresh_ndcg("all-MiniLM-L6-v2", data)}' in metrics.replace("\n", "")
    code, err, _ = cli(capsys, "quickstart", "--data", first, "--out", "quickstart-output/custom")
    assert code == 2 and "differs in: data" in err


@pytest.mark.parametrize(("name", "shown"), [("scifact", "SciFact"), ("nfcorpus", "NFCorpus")])
def test_published_figures_are_recognised_by_the_collections_files(name: str, shown: str):
    known = KNOWN_COLLECTIONS.get(collection_digest(Dataset.open(shared_collection(name))))
    assert known is not None and known.name == shown
