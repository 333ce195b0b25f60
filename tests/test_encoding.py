"""Corpus encoding: the embedding folder, sharding, and resuming a killed run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from densekit.data import DataError, Dataset
from densekit.encoding import corpus as corpus_module
from densekit.encoding.corpus import Shard, encode_corpus
from densekit.encoding.embed import embed_texts
from densekit.encoding.store import EmbeddingStore
from densekit.io.outputs import OutputError
from densekit.models import DenseEncoder

from .conftest import CORPUS


@pytest.fixture(scope="module")
def encoder(tiny_st_model: Path) -> DenseEncoder:
    return DenseEncoder.load(tiny_st_model)


def test_embeddings_are_float32_memory_mapped_beside_ids(encoder, beir_dir: Path, tmp_path: Path):
    encode_corpus(encoder, Dataset.open(beir_dir), tmp_path / "emb", show_progress=False)
    store = EmbeddingStore.open(tmp_path / "emb")
    assert store.ids() == [d["_id"] for d in CORPUS]
    vectors = store.vectors()
    assert isinstance(vectors, np.memmap) and vectors.dtype == np.float32
    texts = [f"{d['title']} {d['text']}".strip() for d in CORPUS]
    assert np.allclose(vectors, embed_texts(encoder, texts, "passage"), atol=1e-6)
    assert store.identity["model"]["settings"]["normalize"] is True


def test_shards_merge_to_the_unsharded_result(encoder, beir_dir: Path, tmp_path: Path):
    dataset = Dataset.open(beir_dir)
    encode_corpus(encoder, dataset, tmp_path / "whole", show_progress=False)
    for index in (2, 0, 1):  # any order, as separate processes would finish
        encode_corpus(encoder, dataset, tmp_path / "parts", Shard(index, 3), show_progress=False)
    whole, parts = EmbeddingStore.open(tmp_path / "whole"), EmbeddingStore.open(tmp_path / "parts")
    assert parts.ids() == whole.ids()
    assert [len(p.ids()) for p in parts.parts] == [2, 3, 3]
    assert np.allclose(parts.vectors(), whole.vectors(), atol=1e-6)


def test_missing_shard_is_reported(encoder, beir_dir: Path, tmp_path: Path):
    encode_corpus(encoder, Dataset.open(beir_dir), tmp_path / "parts", Shard(0, 2), show_progress=False)
    with pytest.raises(DataError, match="missing or incomplete parts 1/2"):
        EmbeddingStore.open(tmp_path / "parts")


def test_shard_syntax():
    assert Shard.parse("1/4") == Shard(1, 4)
    assert Shard(1, 4).bounds(10) == (2, 5)
    for bad in ("4/4", "1-4", "x/2"):
        with pytest.raises(ValueError):
            Shard.parse(bad)


def test_killed_run_resumes_to_the_same_result(encoder, beir_dir: Path, tmp_path: Path, monkeypatch):
    dataset = Dataset.open(beir_dir)
    encode_corpus(encoder, dataset, tmp_path / "straight", chunk_size=3, show_progress=False)

    calls = []
    real = corpus_module.embed_texts

    def dies_on_third_chunk(*args, **kwargs):
        calls.append(len(args[1]))
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(corpus_module, "embed_texts", dies_on_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        encode_corpus(encoder, dataset, tmp_path / "resumed", chunk_size=3, show_progress=False)
    progress = json.loads((tmp_path / "resumed" / "part-00000-of-00001.progress.json").read_text())
    assert progress["done"] == 6
    with pytest.raises(DataError):
        EmbeddingStore.open(tmp_path / "resumed")  # the part is not complete, so it is not read

    calls.clear()
    monkeypatch.setattr(
        corpus_module, "embed_texts", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k)
    )
    encode_corpus(encoder, dataset, tmp_path / "resumed", chunk_size=3, show_progress=False)
    assert calls == [2]  # only the last chunk was encoded again
    straight, resumed = EmbeddingStore.open(tmp_path / "straight"), EmbeddingStore.open(tmp_path / "resumed")
    assert resumed.ids() == straight.ids()
    assert np.array_equal(np.asarray(resumed.vectors()), np.asarray(straight.vectors()))
    assert not list((tmp_path / "resumed").glob("*.partial.npy"))


def test_another_model_is_refused_and_overwrite_starts_over(
    encoder, tiny_model: Path, beir_dir: Path, tmp_path: Path, monkeypatch
):
    dataset = Dataset.open(beir_dir)
    real = corpus_module.embed_texts
    calls = []

    def dies_on_second_chunk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(corpus_module, "embed_texts", dies_on_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        encode_corpus(encoder, dataset, tmp_path / "emb", chunk_size=4, show_progress=False)
    monkeypatch.setattr(corpus_module, "embed_texts", real)
    other = DenseEncoder.load(tiny_model)
    with pytest.raises(OutputError, match=r"differs in: model\.settings\.normalize, "):
        encode_corpus(other, dataset, tmp_path / "emb", chunk_size=4, show_progress=False)
    encode_corpus(other, dataset, tmp_path / "emb", chunk_size=4, show_progress=False, overwrite=True)
    texts = [f"{d['title']} {d['text']}".strip() for d in CORPUS]
    expected = embed_texts(other, texts, "passage")
    assert np.allclose(EmbeddingStore.open(tmp_path / "emb").vectors(), expected, atol=1e-6)


def test_a_finished_part_is_reused_only_for_the_same_model_settings_and_corpus(
    tiny_st_model: Path, beir_dir: Path, tmp_path: Path, monkeypatch
):
    output = tmp_path / "emb"
    encode_corpus(DenseEncoder.load(tiny_st_model), Dataset.open(beir_dir), output, show_progress=False)
    calls = []
    real = corpus_module.embed_texts
    monkeypatch.setattr(corpus_module, "embed_texts", lambda *a, **k: calls.append(1) or real(*a, **k))
    encode_corpus(DenseEncoder.load(tiny_st_model), Dataset.open(beir_dir), output, show_progress=False)
    assert calls == []  # the same encoding: reused

    cls = DenseEncoder.load(tiny_st_model, pooling="cls")
    with pytest.raises(OutputError, match=r"differs in: model\.settings\.pooling\)"):
        encode_corpus(cls, Dataset.open(beir_dir), output, show_progress=False)
    corpus = beir_dir / "corpus.jsonl"
    corpus.write_text(corpus.read_text().replace("Cats are small", "Cats are large"))
    with pytest.raises(OutputError, match=r"differs in: corpus\)"):
        encode_corpus(DenseEncoder.load(tiny_st_model), Dataset.open(beir_dir), output, show_progress=False)
    assert calls == []
    encode_corpus(DenseEncoder.load(tiny_st_model), Dataset.open(beir_dir), output, show_progress=False,
                  overwrite=True)  # fmt: skip
    store = EmbeddingStore.open(output)
    texts = [f"{d['title']} {d['text']}".strip().replace("Cats are small", "Cats are large") for d in CORPUS]
    assert np.allclose(store.vectors(), embed_texts(DenseEncoder.load(tiny_st_model), texts, "passage"),
                       atol=1e-6)  # fmt: skip
    assert store.identity["corpus"] == Dataset.open(beir_dir).corpus_digest()


def test_a_damaged_or_truncated_part_is_refused_naming_the_file(encoder, beir_dir: Path, tmp_path: Path):
    encode_corpus(encoder, Dataset.open(beir_dir), tmp_path / "emb", show_progress=False)
    vectors = tmp_path / "emb" / "part-00000-of-00001.npy"
    data = bytearray(vectors.read_bytes())
    data[-5] ^= 0x01  # one flipped bit in the last vector
    vectors.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"part-00000-of-00001.npy: error: its checksum differs"):
        EmbeddingStore.open(tmp_path / "emb")
    ids = tmp_path / "emb" / "part-00000-of-00001.ids"
    ids.write_text("\n".join(ids.read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(DataError, match=r"part-00000-of-00001\.ids: error: 7 ids for 8 rows"):
        EmbeddingStore.open(tmp_path / "emb")
