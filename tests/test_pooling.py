"""Pooling: the first real token under left padding, and prompts left out as sentence-transformers does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from densekit.encoding.embed import embed_texts
from densekit.models import DenseEncoder
from densekit.models.pooling import pool, without_prompt

TEXTS = ["a short one", "a much longer text with many more words than the first one has in it"]


def test_every_pooling_reads_only_real_tokens_under_left_padding():
    hidden = torch.arange(2 * 4 * 1, dtype=torch.float32).reshape(2, 4, 1)  # token t of row r holds 4r+t
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])  # row 0 padded on the left
    assert pool(hidden, mask, "cls").flatten().tolist() == [2.0, 4.0]  # the first real token, not a pad
    assert pool(hidden, mask, "mean").flatten().tolist() == [2.5, 5.5]
    assert pool(hidden, mask, "last").flatten().tolist() == [3.0, 7.0]
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert pool(hidden, right, "cls").flatten().tolist() == [0.0, 4.0]
    assert without_prompt(mask, 1).tolist() == [[0, 0, 0, 1], [0, 1, 1, 1]]


def prompt_model(source: Path, destination: Path, include_prompt: bool) -> Path:
    """The tiny sentence-transformers model with its pooling's `include_prompt` set."""
    shutil.copytree(source, destination)
    pooling = destination / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "include_prompt": include_prompt}))
    return destination


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_include_prompt_false_pools_as_sentence_transformers_does(
    tiny_st_model: Path, tmp_path: Path, padding_side: str
):
    from sentence_transformers import SentenceTransformer

    path = prompt_model(tiny_st_model, tmp_path / "model", include_prompt=False)
    ours = DenseEncoder.load(path)
    assert ours.config.include_prompt is False
    ours.tokenizer.padding_side = padding_side
    theirs = SentenceTransformer(str(path), device="cpu")
    theirs.tokenizer.padding_side = padding_side
    for kind, prompt in (("query", "query"), ("passage", "document")):
        expected = theirs.encode(TEXTS, prompt_name=prompt, convert_to_numpy=True)
        assert np.allclose(embed_texts(ours, TEXTS, kind, batch_size=2), expected, atol=1e-5)
    with_prompt = DenseEncoder.load(prompt_model(tiny_st_model, tmp_path / "with", include_prompt=True))
    differ = embed_texts(with_prompt, TEXTS, "query") - embed_texts(ours, TEXTS, "query")
    assert np.abs(differ).max() > 1e-3


def test_include_prompt_survives_a_save(tiny_st_model: Path, tmp_path: Path):
    encoder = DenseEncoder.load(prompt_model(tiny_st_model, tmp_path / "model", include_prompt=False))
    encoder.save(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "1_Pooling" / "config.json").read_text())
    assert saved["include_prompt"] is False
    assert DenseEncoder.load(tmp_path / "saved").config.include_prompt is False
