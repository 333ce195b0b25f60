"""Choosing the device and the numeric precision of inference."""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

Precision = Literal["float32", "bf16", "fp16"]
_AUTOCAST_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` is the first GPU when there is one, else the CPU; anything else goes to torch as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no GPU")
    return resolved


def autocast(device: torch.device, precision: Precision) -> contextlib.AbstractContextManager:
    """Mixed precision for `precision` on `device`; float32 needs no context. fp16 needs a GPU."""
    if precision == "float32":
        return contextlib.nullcontext()
    if precision not in _AUTOCAST_TYPES:
        raise ValueError(f"unknown precision {precision!r}: expected float32, bf16 or fp16")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("fp16 needs a GPU; use bf16 or float32 on the CPU")
    return torch.autocast(device_type=device.type, dtype=_AUTOCAST_TYPES[precision])
