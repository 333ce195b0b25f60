"""Real-data reproductions on SciFact with the bundled all-MiniLM-L6-v2 (slow: minutes of CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from densekit.cli import app
from densekit.data import Dataset
from densekit.encoding.store import EmbeddingStore
from densekit.index import SearchIndex

from .conftest import MINILM, shared_collection

pytestmark = pytest.mark.slow


def cli(*args) -> None:
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def scifact_embeddings(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = shared_collection("scifact")
    folder = tmp_path_factory.mktemp("scifact") / "emb"
    cli("encode", MINILM, data, "-o", folder, "--no-progress")
    return folder


def test_minilm_zero_shot_through_the_cli(scifact_embeddings: Path, tmp_path: Path):
    """encode -> index -> search -> evaluate gives MTEB's 0.6451 nDCG@10 on SciFact test."""
    data = shared_collection("scifact")
    cli("index", scifact_embeddings, "-o", tmp_path / "flat", "--no-progress")
    cli(
        "search",
        MINILM,
        tmp_path / "flat",
        data,
        "--split",
        "test",
        "-o",
        tmp_path / "run.trec",
        "--no-progress",
    )
    cli("evaluate", data / "qrels" / "test.tsv", tmp_path / "run.trec", "--json", tmp_path / "m.json")
    scores = json.loads((tmp_path / "m.json").read_text())
    assert abs(scores["nDCG@10"] - 0.645) <= 0.003


def _recall_at_100(approximate: SearchIndex, exact: SearchIndex, queries: np.ndarray) -> float:
    found = approximate.search(queries, 100).labels
    truth = exact.search(queries, 100).labels
    return float(np.mean([len(set(f) & set(t)) / 100 for f, t in zip(found, truth, strict=True)]))


def test_hnsw_recall_against_flat(scifact_embeddings: Path, tmp_path: Path):
    """HNSW's recall@100 of the flat index's top 100, for SciFact's test queries, is at least 0.98."""
    from densekit.encoding.embed import embed_texts
    from densekit.models import DenseEncoder

    queries, _ = Dataset.open(shared_collection("scifact")).split_queries("test")
    vectors = embed_texts(DenseEncoder.load(MINILM), list(queries.values()), "query")
    cli("index", scifact_embeddings, "-o", tmp_path / "flat", "--no-progress")
    cli("index", scifact_embeddings, "-o", tmp_path / "hnsw", "--type", "hnsw", "--no-progress")
    recall = _recall_at_100(SearchIndex.load(tmp_path / "hnsw"), SearchIndex.load(tmp_path / "flat"), vectors)
    assert recall >= 0.98
    assert len(EmbeddingStore.open(scifact_embeddings)) == 5183
