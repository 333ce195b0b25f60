"""Pooling token states into one vector per text."""

from __future__ import annotations

import torch

from densekit.models.config import Pooling


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: Pooling) -> torch.Tensor:
    """Pool `hidden` (batch, tokens, dim) over the tokens that `attention_mask` keeps.

    `cls` takes the first position, `mean` averages the kept tokens, `last` takes the last kept token
    (wherever padding sits, left or right).
    """
    if mode == "cls":
        return hidden[:, 0]
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    if mode == "mean":
        return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    if mode == "last":
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (attention_mask.long() * positions).argmax(dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"unknown pooling {mode!r}: expected cls, mean or last")
