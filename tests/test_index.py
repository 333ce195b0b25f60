"""Faiss indexes: exactness of flat search, approximate types, saving, loading and the run's ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from densekit.data import DataError, Dataset, Diagnostics
from densekit.data.trec import read_run, write_run
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.store import KIND, EmbeddingStore, complete_part
from densekit.index import IndexSpec, SearchIndex, build_index
from densekit.io.artefact import write_folder_manifest
from densekit.mining.filters import MiningSettings
from densekit.mining.mine import mine
from densekit.models import DenseEncoder
from densekit.retrieval.dense import dense_search
from densekit.retrieval.hits import Hits

from .conftest import CORPUS


def fake_store(folder: Path, vectors: np.ndarray, parts: int = 1) -> EmbeddingStore:
    """An embedding folder written directly, part by part, as `densekit encode` would."""
    folder.mkdir(parents=True)
    identity = {"model": {"weights": "w", "settings": {}}, "corpus": "c", "shards": parts, "maxp": None}
    write_folder_manifest(folder, KIND, identity)
    ids = [f"doc{i}" for i in range(len(vectors))]
    bounds = np.linspace(0, len(vectors), parts + 1).astype(int)
    for p in range(parts):
        lo, hi = bounds[p], bounds[p + 1]
        partial = folder / f"part-{p}.partial.npy"
        np.save(partial, vectors[lo:hi].astype(np.float32))
        meta = {"identity": identity, "dimension": vectors.shape[1], "rows": int(hi - lo)}
        complete_part(folder, p, parts, partial, ids[lo:hi], meta)
    return EmbeddingStore.open(folder)


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    rng = np.random.default_rng(0)
    data = rng.standard_normal((3000, 32)).astype(np.float32)
    return data / np.linalg.norm(data, axis=1, keepdims=True)


def test_flat_index_is_exact_and_survives_a_reload(vectors, tmp_path: Path):
    store = fake_store(tmp_path / "emb", vectors, parts=3)
    build_index(store, IndexSpec(type="flat"), tmp_path / "index", show_progress=False)
    index = SearchIndex.load(tmp_path / "index")
    queries = vectors[:5] + 0.01
    hits = index.search(queries, 10)
    scores, ids = hits.scores, hits.doc_ids()
    exact = queries @ vectors.T
    expected = np.argsort(-exact, axis=1)[:, :10]
    assert ids.tolist() == [[f"doc{j}" for j in row] for row in expected]
    assert np.allclose(scores, np.take_along_axis(exact, expected, axis=1), atol=1e-5)


@pytest.mark.parametrize("spec", [IndexSpec(type="hnsw"), IndexSpec(type="ivfpq", nprobe=64)])
def test_approximate_indexes_find_most_true_neighbours(vectors, tmp_path: Path, spec: IndexSpec):
    store = fake_store(tmp_path / "emb", vectors)
    build_index(store, spec, tmp_path / "index", show_progress=False)
    index = SearchIndex.load(tmp_path / "index")
    assert index.spec.type == spec.type
    found = index.search(vectors[:50], 10).doc_ids()
    expected = np.argsort(-(vectors[:50] @ vectors.T), axis=1)[:, :10]
    recall = np.mean(
        [len(set(f) & {f"doc{j}" for j in e}) / 10 for f, e in zip(found, expected, strict=True)]
    )
    assert recall > (0.95 if spec.type == "hnsw" else 0.3)


def test_ivfpq_parameters_are_chosen_from_the_corpus():
    spec = IndexSpec(type="ivfpq").resolved(rows=5183, dimension=384)
    assert spec.nlist == 5183 // 39 and spec.pq_m == 96 and spec.pq_bits == 7
    assert IndexSpec(type="ivfpq").resolved(rows=1_000_000, dimension=768).pq_bits == 8


def test_search_parameters_can_be_overridden(vectors, tmp_path: Path):
    store = fake_store(tmp_path / "emb", vectors)
    build_index(store, IndexSpec(type="hnsw", ef_search=16), tmp_path / "index", show_progress=False)
    index = SearchIndex.load(tmp_path / "index")
    import faiss

    assert faiss.downcast_index(index.index).hnsw.efSearch == 16
    index.set_search_parameters(ef_search=300)
    assert faiss.downcast_index(index.index).hnsw.efSearch == 300


def test_wrong_query_dimension_is_an_error(vectors, tmp_path: Path):
    build_index(fake_store(tmp_path / "emb", vectors), IndexSpec(), tmp_path / "index", show_progress=False)
    with pytest.raises(ValueError, match="dimension 32"):
        SearchIndex.load(tmp_path / "index").search(np.zeros((1, 8), dtype=np.float32), 3)


def test_runs_skip_the_query_itself_and_have_real_ranks(tmp_path: Path):
    scores = np.array([[0.9, 0.8, 0.7], [0.5, 0.4, -1.0]])
    labels = np.array([[0, 1, 2], [3, 0, -1]])
    hits = Hits(scores, labels, np.array(["q1", "a", "b", "c"], dtype=object))
    assert hits.doc_ids().tolist() == [["q1", "a", "b"], ["c", "q1", None]]
    run = hits.to_run(["q1", "q2"], k=2)
    assert run == {"q1": {"a": 0.8, "b": 0.7}, "q2": {"c": 0.5, "q1": 0.4}}
    assert list(run["q1"]) == ["a", "b"]  # best first
    write_run(tmp_path / "run.trec", run)
    lines = (tmp_path / "run.trec").read_text().splitlines()
    assert lines[0].split()[:4] == ["q1", "Q0", "a", "1"] and lines[1].split()[3] == "2"
    assert read_run(tmp_path / "run.trec", Diagnostics()) == run


def test_a_bit_flipped_index_is_refused_on_load(vectors, tmp_path: Path):
    build_index(fake_store(tmp_path / "emb", vectors), IndexSpec(), tmp_path / "index", show_progress=False)
    index_file = tmp_path / "index" / "index.faiss"
    data = bytearray(index_file.read_bytes())
    data[len(data) // 2] ^= 0x10
    index_file.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"index.faiss: error: its checksum differs from the one saved"):
        SearchIndex.load(tmp_path / "index")


@pytest.fixture
def other_collection(make_beir) -> Path:
    """The same queries and judgements over a corpus that lacks one document and has another."""
    corpus = [d for d in CORPUS if d["_id"] != "d6"] + [{"_id": "x1", "title": "", "text": "a new text"}]
    return make_beir(corpus=corpus)


def test_an_index_of_another_corpus_or_model_is_refused_by_search_and_mining(
    tiny_st_model: Path, beir_dir: Path, other_collection: Path, tmp_path: Path
):
    encoder = DenseEncoder.load(tiny_st_model)
    encode_corpus(encoder, Dataset.open(other_collection), tmp_path / "emb", show_progress=False)
    build_index(EmbeddingStore.open(tmp_path / "emb"), IndexSpec(), tmp_path / "index", show_progress=False)
    index = SearchIndex.load(tmp_path / "index")
    dataset = Dataset.open(beir_dir)
    queries, _ = dataset.split_queries("test")
    with pytest.raises(ValueError, match=r"built from another corpus than .*corpus.jsonl"):
        dense_search(encoder, index, queries, 3, dataset=dataset, show_progress=False)
    for keep_identical in (False, True):
        settings = MiningSettings(first_rank=1, last_rank=5, count=2, exclude_identical=not keep_identical)
        with pytest.raises(ValueError, match=r"built from another corpus"):
            mine(dataset, "test", tmp_path / "mined.jsonl", "dense", settings, encoder, tmp_path / "index",
                 show_progress=False)  # fmt: skip
    assert not (tmp_path / "mined.jsonl").exists()
    other = DenseEncoder.load(tiny_st_model)
    torch.nn.init.normal_(other.query_backbone.embeddings.word_embeddings.weight)
    with pytest.raises(ValueError, match=r"other model weights"):
        dense_search(other, index, queries, 3, show_progress=False)
    with pytest.raises(ValueError, match=r"other settings \(pooling 'mean' there, 'cls' here\)"):
        dense_search(DenseEncoder.load(tiny_st_model, pooling="cls"), index, queries, 3, show_progress=False)
    own = Dataset.open(other_collection)
    assert dense_search(encoder, index, own.split_queries("test")[0], 3, dataset=own, show_progress=False)
