"""A BERT forward pass over a padded batch that computes only the real tokens: the embeddings, the
attention projections and the feed-forward layers run on the batch's tokens packed together, and only
the attention itself sees the padded layout. Short queries gathered from concurrent requests pad to
their longest, and on a CPU that padding cost the service up to 1.6x the model's own CPU per query.

By hand: transformers skips padding only through flash-attention's variable-length kernels, which need a
GPU; on a CPU its BERT computes every padded position. The weights and modules are transformers' own
(called as they are), so the hidden states agree with `BertModel`'s to float rounding (tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import BertModel


def packs(backbone: torch.nn.Module) -> bool:
    """Whether `packed_hidden` computes `backbone`'s inference: a plain transformers `BertModel` (not a
    subclass), an encoder without cross-attention."""
    config = getattr(backbone, "config", None)
    return (
        type(backbone) is BertModel
        and not getattr(config, "is_decoder", False)
        and not getattr(config, "add_cross_attention", False)
    )


def packed_hidden(backbone: BertModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`backbone(input_ids, attention_mask).last_hidden_state` (batch, tokens, width) for the tokens the
    mask keeps, computed on those tokens alone; padded positions hold zeros."""
    rows, length = input_ids.shape
    kept = attention_mask.reshape(-1).nonzero().squeeze(1)
    # positions as BertModel gives them: 0 .. length-1 along each row, padding (left or right) included
    positions = torch.arange(length, device=input_ids.device).repeat(rows)[kept]
    embeddings = backbone.embeddings
    tokens = embeddings.word_embeddings(input_ids.reshape(-1)[kept])
    hidden = tokens + embeddings.token_type_embeddings.weight[0]  # type 0, as BertModel's default
    hidden = embeddings.LayerNorm(hidden + embeddings.position_embeddings(positions))
    width = hidden.shape[-1]
    keys_kept = attention_mask.bool()[:, None, None, :]

    def padded_heads(packed: torch.Tensor, heads: int) -> torch.Tensor:
        full = packed.new_zeros(rows * length, width)
        full[kept] = packed
        return full.view(rows, length, heads, width // heads).transpose(1, 2)

    for layer in backbone.encoder.layer:
        attention = layer.attention.self
        heads = attention.num_attention_heads
        query, key, value = (padded_heads(project(hidden), heads)
                             for project in (attention.query, attention.key, attention.value))  # fmt: skip
        mixed = F.scaled_dot_product_attention(query, key, value, attn_mask=keys_kept,
                                               scale=getattr(attention, "scaling", None))  # fmt: skip
        mixed = mixed.transpose(1, 2).reshape(rows * length, width)[kept]
        output = layer.attention.output
        hidden = output.LayerNorm(output.dense(mixed) + hidden)
        inner = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(hidden))
        hidden = layer.output.LayerNorm(layer.output.dense(inner) + hidden)
    result = hidden.new_zeros(rows * length, width)
    result[kept] = hidden
    return result.view(rows, length, width)
