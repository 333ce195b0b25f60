"""A BERT forward pass over a padded batch that computes only the real tokens: the embeddings, the
attention projections and the feed-forward layers run on the batch's tokens packed together, and the
attention itself on groups of consecutive texts, each group padded only to its own longest. Short
queries gathered from concurrent requests pad to their longest, and on a CPU that padding cost the
service up to 1.6x the model's own CPU per query.

By hand: transformers skips padding only through flash-attention's variable-length kernels, which need a
GPU; on a CPU its BERT computes every padded position. The weights and modules are transformers' own
(called as they are), so the hidden states agree with `BertModel`'s to float rounding (tests)."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import BertModel

from densekit.inference import length_batches

log = logging.getLogger("densekit")
_TOLD: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models whose unpacked inference was logged

# What one more attention call costs beside its arithmetic, in units of one text's attention over one
# pair of its tokens (a group costs its texts times its longest text squared, plus this): on SciFact's
# queries gathered 32 at a time, 4,096 ran 6% below one padded call and 1,024 3%.
ATTENTION_CALL_PAIRS = 4096


@dataclass(frozen=True)
class _Group:
    """Consecutive texts whose attention runs together: their tokens, `first` to `end` in packed order,
    laid out as `rows` x `length` with `kept` naming the real positions; `keys` masks the padding."""

    first: int
    end: int
    rows: int
    length: int
    kept: torch.Tensor
    keys: torch.Tensor


def packs(backbone: torch.nn.Module) -> bool:
    """Whether `packed_hidden` computes `backbone`'s inference: a plain transformers `BertModel` (not a
    subclass), an encoder without cross-attention, with absolute positions. Relative ones
    (`position_embedding_type: relative_key`, which transformers 4 computes) are left to transformers'
    padded pass, said once a model."""
    config = getattr(backbone, "config", None)
    if not (
        type(backbone) is BertModel
        and not getattr(config, "is_decoder", False)
        and not getattr(config, "add_cross_attention", False)
    ):
        return False
    positions = getattr(config, "position_embedding_type", "absolute")
    if positions == "absolute":
        return True
    if backbone not in _TOLD:
        _TOLD.add(backbone)
        log.info("a BERT with position_embedding_type %r is run by transformers over its padded batches: "
                 "packed inference adds absolute positions only", positions)  # fmt: skip
    return False


def packed_hidden(backbone: BertModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`backbone(input_ids, attention_mask).last_hidden_state` (batch, tokens, width) for the tokens the
    mask keeps, computed on those tokens alone; padded positions hold zeros."""
    rows, length = input_ids.shape
    kept = attention_mask.reshape(-1).nonzero().squeeze(1)  # row by row: each text's tokens in a run
    # positions as BertModel gives them: 0 .. length-1 along each row, padding (left or right) included
    positions = torch.arange(length, device=input_ids.device).repeat(rows)[kept]
    embeddings = backbone.embeddings
    tokens = embeddings.word_embeddings(input_ids.reshape(-1)[kept])
    hidden = tokens + embeddings.token_type_embeddings.weight[0]  # type 0, as BertModel's default
    hidden = embeddings.LayerNorm(hidden + embeddings.position_embeddings(positions))
    groups = attention_groups(attention_mask)
    for layer in backbone.encoder.layer:
        attention = layer.attention.self
        query, key, value = (project(hidden) for project in (attention.query, attention.key, attention.value))
        mixed = hidden.new_empty(hidden.shape[0], query.shape[-1])  # narrower when heads were pruned
        for group in groups:
            heads = [_padded(x[group.first : group.end], group, attention.num_attention_heads)
                     for x in (query, key, value)]  # fmt: skip
            out = F.scaled_dot_product_attention(*heads, attn_mask=group.keys,
                                                 scale=getattr(attention, "scaling", None))  # fmt: skip
            laid_out = out.transpose(1, 2).reshape(group.rows * group.length, -1)
            mixed[group.first : group.end] = laid_out[group.kept]
        output = layer.attention.output
        hidden = output.LayerNorm(output.dense(mixed) + hidden)
        inner = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(hidden))
        hidden = layer.output.LayerNorm(layer.output.dense(inner) + hidden)
    result = hidden.new_zeros(rows * length, hidden.shape[-1])
    result[kept] = hidden
    return result.view(rows, length, -1)


def attention_groups(attention_mask: torch.Tensor) -> list[_Group]:
    """The batch's texts in groups of consecutive rows: where they run longest first (as inference
    sorts them), cut where padding a group's attention to its longest costs more than another call;
    otherwise one group."""
    lengths = attention_mask.sum(dim=1).cpu().numpy().astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    if np.all(lengths[:-1] >= lengths[1:]):
        bounds = length_batches(lengths**2, len(lengths), ATTENTION_CALL_PAIRS)
    else:
        bounds = [(0, len(lengths))]
    groups = []
    for first_row, end_row in bounds:
        mask = attention_mask[first_row:end_row]
        columns = mask.any(dim=0).nonzero().squeeze(1)  # a run, with padding on either side
        mask = mask[:, int(columns[0]) : int(columns[-1]) + 1]
        kept = mask.reshape(-1).nonzero().squeeze(1)
        groups.append(_Group(int(starts[first_row]), int(starts[end_row]), mask.shape[0], mask.shape[1], kept,
                             mask.bool()[:, None, None, :]))  # fmt: skip
    return groups


def _padded(packed: torch.Tensor, group: _Group, heads: int) -> torch.Tensor:
    """A group's packed tokens (tokens, width) laid out padded: (rows, heads, length, width / heads)."""
    full = packed.new_zeros(group.rows * group.length, packed.shape[-1])
    full[group.kept] = packed
    return full.view(group.rows, group.length, heads, -1).transpose(1, 2)
