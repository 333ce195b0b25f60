"""BERT inference on the real tokens alone (`densekit.models.packed`) against transformers' own forward
pass over the padded batch: the same hidden states and vectors, with right and left padding; taken only
where it applies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel, DistilBertConfig, DistilBertModel

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
            packed = encoder(inputs["input_ids"], inputs["attention_mask"], side="query")
        assert not whole_passes
        padded = encoder(inputs["input_ids"], inputs["attention_mask"], side="query").detach()  # autograd
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
    assert not with_module.computes_only_tokens("query", "probe")
    assert with_module.computes_only_tokens("query")  # the encoder's own: the base alone


def test_a_batch_without_padding_runs_transformers_own_pass(encoder: DenseEncoder):
    inputs = encoder.pad(encoder.tokenize(["the same query"] * 3, "query"))
    assert inputs["attention_mask"].all()
    whole_passes: list[int] = []
    hook = encoder.backbone("query").register_forward_hook(lambda *_: whole_passes.append(1))
    encoder.eval()
    try:
        with torch.inference_mode():
            encoder(inputs["input_ids"], inputs["attention_mask"], side="query")
    finally:
        hook.remove()
    assert whole_passes  # packing would only add its gathers


# BertConfig fields that change what a BERT computes in inference: packing must give transformers' own
# vectors under each, or leave the batch to transformers (relative positions, which transformers 4.x
# computes and `packed_hidden` does not; transformers 5 dropped them and adds absolute positions).
CONFIG_VARIANTS = {
    "absolute positions": {"position_embedding_type": "absolute"},
    "relative_key": {"position_embedding_type": "relative_key"},
    "relative_key_query": {"position_embedding_type": "relative_key_query"},
    "no position type": {"position_embedding_type": None},
    "pruned heads": {"pruned_heads": {0: [1]}},
    "another activation and eps": {"hidden_act": "gelu_new", "layer_norm_eps": 1e-3},
    "chunked feed-forward": {"chunk_size_feed_forward": 1},
    "eager attention": {"attn_implementation": "eager"},
}


@pytest.mark.parametrize("variant", CONFIG_VARIANTS)
def test_inference_gives_transformers_vectors_whatever_the_bert_config(
    tiny_model: Path, tmp_path: Path, variant: str
):
    config = BertConfig.from_pretrained(tiny_model)
    for key, value in CONFIG_VARIANTS[variant].items():
        setattr(config, key, value)
    torch.manual_seed(3)
    BertModel(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path)
    encoder = DenseEncoder.load(tmp_path, pooling="mean").eval()
    inputs = encoder.pad(encoder.tokenize(TEXTS, "query"))
    with torch.inference_mode():  # inference: packed where densekit packs this BERT
        inferred = encoder(inputs["input_ids"], inputs["attention_mask"], side="query")
        theirs = encoder.backbone("query")(**inputs).last_hidden_state
    padded = encoder(inputs["input_ids"], inputs["attention_mask"], side="query").detach()  # autograd
    mask = inputs["attention_mask"].unsqueeze(-1).float()
    torch.testing.assert_close(padded, (theirs * mask).sum(1) / mask.sum(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inferred, padded, atol=1e-5, rtol=1e-5)


def test_a_bert_with_relative_positions_is_left_to_transformers_and_said_once(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    config = BertConfig.from_pretrained(tiny_model)
    config.position_embedding_type = "relative_key"
    BertModel(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path)
    encoder = DenseEncoder.load(tmp_path).eval()
    with caplog.at_level("INFO", logger="densekit"):
        assert not encoder.computes_only_tokens("query")
        embed_texts(encoder, TEXTS, "query", 4)
        embed_texts(encoder, TEXTS, "passage", 4)
    told = [r.getMessage() for r in caplog.records if "position_embedding_type" in r.getMessage()]
    assert told == ["a BERT with position_embedding_type 'relative_key' is run by transformers over its "
                    "padded batches: packed inference adds absolute positions only"]  # fmt: skip
