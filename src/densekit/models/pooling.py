"""Pooling token states into one vector per text."""

from __future__ import annotations

import torch

from densekit.errors import InputError
from densekit.models.config import Pooling


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: Pooling) -> torch.Tensor:
    """Pool `hidden` (batch, tokens, dim) over the tokens that `attention_mask` keeps.

    `cls` takes the first kept token, `mean` averages the kept tokens, `last` takes the last kept
    token (wherever padding sits, left or right).
    """
    if mode == "cls":
        first = attention_mask.long().argmax(dim=1)  # 0 with right padding, past the pads with left
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), first]
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    if mode == "mean":
        return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    if mode == "last":
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (attention_mask.long() * positions).argmax(dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise InputError(f"unknown pooling {mode!r}: expected cls, mean or last")


def without_prompt(attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """A copy of `attention_mask` that no longer keeps the first `prompt_length` tokens of each text
    (after its left padding, if any), as sentence-transformers pools with `include_prompt: false`."""
    first = attention_mask.long().argmax(dim=1, keepdim=True)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device).unsqueeze(0)
    return attention_mask.masked_fill(positions < first + prompt_length, 0)
