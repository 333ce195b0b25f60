"""The Milvus backend, through Milvus Lite: the same hits as the flat Faiss index, and the same rules
about what may be written and reused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from densekit.cli.main import app
from densekit.data.dataset import Dataset
from densekit.diagnostics import DataError
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.store import EmbeddingStore
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.index.backends.milvus_index import MilvusSearchIndex, build_milvus_index
from densekit.io.outputs import OutputError
from densekit.models import DenseEncoder
from densekit.retrieval.retriever import Retriever

from .conftest import shared_collection

pytest.importorskip("milvus_lite")


@pytest.fixture(scope="module")
def scifact_embeddings(tmp_path_factory: pytest.TempPathFactory, tiny_st_model: Path) -> tuple[Path, Path]:
    """SciFact's corpus encoded by the tiny model (real texts, 5,183 documents): (data, embeddings)."""
    data = shared_collection("scifact")
    folder = tmp_path_factory.mktemp("scifact") / "emb"
    encode_corpus(DenseEncoder.load(tiny_st_model), Dataset.open(data), folder, show_progress=False)
    return data, folder


def test_milvus_gives_the_flat_faiss_top_10_on_scifact(
    scifact_embeddings, tiny_st_model: Path, tmp_path: Path
):
    data, embeddings = scifact_embeddings
    store = EmbeddingStore.open(embeddings)
    build_index(store, IndexSpec(type="flat"), tmp_path / "faiss", show_progress=False)
    build_milvus_index(store, tmp_path / "milvus", str(tmp_path / "m.db"), "scifact", show_progress=False)
    milvus = SearchIndex.load(tmp_path / "milvus")
    assert isinstance(milvus, MilvusSearchIndex) and milvus.rows == len(store)
    encoder = DenseEncoder.load(tiny_st_model)
    queries, _ = Dataset.open(data).split_queries("test")
    dataset = Dataset.open(data)
    exact = Retriever(encoder, SearchIndex.load(tmp_path / "faiss"), dataset=dataset).search_run(queries, 10)
    served = Retriever(encoder, milvus, dataset=dataset).search_run(queries, 10)
    assert_same_top_10(served, exact)


def assert_same_top_10(served: dict, exact: dict) -> None:
    """Every query's hits in the same order with the same scores, up to ties within float error."""
    assert list(served) == list(exact)
    for query in exact:
        ours, theirs = list(served[query].items()), list(exact[query].items())
        assert [s for _, s in ours] == pytest.approx([s for _, s in theirs], abs=1e-5)
        for (doc, score), (other, other_score) in zip(ours, theirs, strict=True):
            assert doc == other or abs(score - other_score) < 1e-5


def test_two_encoding_processes_make_one_folder_and_milvus_filled_from_its_parts_gives_the_flat_top_10(
    scifact_embeddings, tiny_st_model: Path, tmp_path: Path
):
    """`--shard 1/2` and `0/2` run at once as two processes, finishing in either order, write one folder
    equal to one process's encoding; Milvus filled from its two parts answers as the flat index does."""
    data, whole = scifact_embeddings
    sharded = tmp_path / "sharded"
    encode = [sys.executable, "-m", "densekit", "--quiet", "encode", str(tiny_st_model), str(data)]
    children = [
        subprocess.Popen(
            [*encode, "-o", str(sharded), "--shard", shard, "--no-progress"],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for shard in ("1/2", "0/2")
    ]
    for child in children:
        assert child.wait() == 0, child.stderr.read()
    parts, single = EmbeddingStore.open(sharded), EmbeddingStore.open(whole)
    assert len(parts.parts) == 2 and parts.ids() == single.ids()
    assert np.allclose(parts.vectors(), single.vectors(), atol=1e-6)
    build_index(single, IndexSpec(type="flat"), tmp_path / "faiss", show_progress=False)
    build_milvus_index(parts, tmp_path / "milvus", str(tmp_path / "m.db"), "sharded", show_progress=False)
    dataset = Dataset.open(data)
    queries, _ = dataset.split_queries("test")
    encoder = DenseEncoder.load(tiny_st_model)
    exact = Retriever(encoder, SearchIndex.load(tmp_path / "faiss"), dataset=dataset).search_run(queries, 10)
    served = Retriever(encoder, SearchIndex.load(tmp_path / "milvus"), dataset=dataset).search_run(
        queries, 10
    )
    assert_same_top_10(served, exact)


def test_a_collection_densekit_did_not_make_is_never_written(scifact_embeddings, tmp_path: Path):
    from pymilvus import MilvusClient

    uri = str(tmp_path / "m.db")
    client = MilvusClient(uri)
    client.create_collection("theirs", dimension=32)
    client.insert("theirs", [{"id": 1, "vector": np.ones(32).tolist()}])
    store = EmbeddingStore.open(scifact_embeddings[1])
    with pytest.raises(OutputError, match=r"'theirs' .* was not made by densekit"):
        build_milvus_index(store, tmp_path / "index", uri, "theirs", overwrite=True, show_progress=False)
    assert client.get_collection_stats("theirs")["row_count"] == 1


def test_a_rewritten_collection_is_refused_and_a_same_one_reused(
    scifact_embeddings, beir_dir: Path, tiny_st_model: Path, tmp_path: Path
):
    uri = str(tmp_path / "m.db")
    first = EmbeddingStore.open(scifact_embeddings[1])
    build_milvus_index(first, tmp_path / "first", uri, "docs", show_progress=False)
    build_milvus_index(first, tmp_path / "again", uri, "docs", show_progress=False)  # reused: nothing written
    encode_corpus(
        DenseEncoder.load(tiny_st_model), Dataset.open(beir_dir), tmp_path / "emb", show_progress=False
    )
    other = EmbeddingStore.open(tmp_path / "emb")
    with pytest.raises(OutputError, match="holds other embeddings; pass --overwrite"):
        build_milvus_index(other, tmp_path / "other", uri, "docs", show_progress=False)
    build_milvus_index(other, tmp_path / "other", uri, "docs", overwrite=True, show_progress=False)
    assert SearchIndex.load(tmp_path / "other").rows == len(other)
    with pytest.raises(DataError, match="no longer holds its embeddings"):
        SearchIndex.load(tmp_path / "first")


def test_the_index_command_writes_a_milvus_index_that_search_reads(
    beir_dir: Path, tiny_st_model: Path, tmp_path
):
    encode_corpus(
        DenseEncoder.load(tiny_st_model), Dataset.open(beir_dir), tmp_path / "emb", show_progress=False
    )

    def densekit(*args: str) -> None:
        result = CliRunner().invoke(app, [*args, "--no-progress"])
        assert result.exit_code == 0, result.output

    emb = str(tmp_path / "emb")
    densekit("index", emb, "-o", str(tmp_path / "mv"), "--backend", "milvus", "--uri", str(tmp_path / "m.db"))
    densekit("index", emb, "-o", str(tmp_path / "flat"))
    runs = []
    for index in ("mv", "flat"):
        output = tmp_path / f"{index}.trec"
        densekit(
            "search", str(tiny_st_model), str(tmp_path / index), str(beir_dir), "-o", str(output), "--k", "3"
        )
        runs.append([line.split()[:4] for line in output.read_text().splitlines()])
    assert runs[0] == runs[1]
