"""BERT inference on the real tokens alone (`densekit.models.packed`) against transformers' own forward
pass over the padded batch: the same hidden states and vectors, with right and left padding; taken only
where it applies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel, DistilBertConfig, DistilBertModel

from densekit.encoding.embed import embed_texts
from densekit.models import DenseEncoder
from densekit.models.modules.kinds.lora import LoraSpec
from densekit.models.packed import attention_groups, packed_hidden, packs

TEXTS = ["a", "a short query", "a longer query about cells, genes and the proteins they make " * 3, "two"]


@pytest.fixture(scope="module")
def encoder(tiny_model: Path) -> DenseEncoder:
    return DenseEncoder.load(tiny_model)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("order", ["as given", "longest first"])
def test_hidden_states_are_bert_models_on_kept_tokens_and_zero_on_padding(
    encoder: DenseEncoder, side: str, order: str
):
    backbone = encoder.backbone("query").eval()
    token_ids = encoder.tokenize([*TEXTS, "a query long enough to take its attention apart " * 6], "query")
    if order == "longest first":  # as inference sorts them: attention then runs in groups by length
        token_ids.sort(key=len, reverse=True)
    encoder.tokenizer.padding_side = side
    try:
        inputs = encoder.pad(token_ids)
    finally:
        encoder.tokenizer.padding_side = "right"
    kept = inputs["attention_mask"].bool()
    assert not kept.all()  # the batch holds padding
    assert len(attention_groups(inputs["attention_mask"])) == (1 if order == "as given" else 2)
    with torch.inference_mode():
        expected = backbone(**inputs).last_hidden_state
        packed = packed_hidden(backbone, inputs["input_ids"], inputs["attention_mask"])
    torch.testing.assert_close(packed[kept], expected[kept], atol=1e-5, rtol=1e-5)
    assert not packed[~kept].any()


def test_the_encoders_vectors_in_inference_are_those_of_the_padded_forward_pass(encoder: DenseEncoder):
    assert encoder.computes_only_tokens("query")
    inputs = encoder.pad(encoder.tokenize(TEXTS, "query"))
    encoder.eval()
    whole_passes: list[int] = []  # transformers' forward pass over the padded batch, each time it runs
    hook = encoder.backbone("query").register_forward_hook(lambda *_: whole_passes.append(1))
    try:
        with torch.inference_mode():
            packed = encoder(inputs["input_ids"], inputs["attention_mask"], kind="query")
        assert not whole_passes
        padded = encoder(inputs["input_ids"], inputs["attention_mask"], kind="query").detach()  # autograd
        assert whole_passes
    finally:
        hook.remove()
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    one_at_a_time = np.concatenate([embed_texts(encoder, [text], "query", 1) for text in TEXTS])
    np.testing.assert_allclose(embed_texts(encoder, TEXTS, "query", 4), one_at_a_time, atol=1e-5)


def test_only_a_plain_bert_encoder_is_packed(tiny_model: Path):
    assert packs(BertModel(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=8)))  # fmt: skip

    class OwnBert(BertModel):
        pass

    assert not packs(OwnBert(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2)))
    assert not packs(DistilBertModel(DistilBertConfig(dim=8, n_layers=1, n_heads=2, hidden_dim=8)))
    assert not packs(BertModel(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                          is_decoder=True)))  # fmt: skip
    with_module = DenseEncoder.load(tiny_model)
    with_module.new_module(LoraSpec(name="probe", rank=2, alpha=4, dropout=0.0))
    assert not with_module.computes_only_tokens("query")
    with_module.activate(None)
    assert with_module.computes_only_tokens("query")


def test_a_batch_without_padding_runs_transformers_own_pass(encoder: DenseEncoder):
    inputs = encoder.pad(encoder.tokenize(["the same query"] * 3, "query"))
    assert inputs["attention_mask"].all()
    whole_passes: list[int] = []
    hook = encoder.backbone("query").register_forward_hook(lambda *_: whole_passes.append(1))
    encoder.eval()
    try:
        with torch.inference_mode():
            encoder(inputs["input_ids"], inputs["attention_mask"], kind="query")
    finally:
        hook.remove()
    assert whole_passes  # packing would only add its gathers
