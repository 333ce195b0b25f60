"""Choosing the device and the numeric precision of inference."""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

from densekit.errors import SettingError

Precision = Literal["float32", "bf16", "fp16"]
_AUTOCAST_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` is the first GPU when there is one, else the CPU; anything else goes to torch as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise SettingError(f"device {device!r} asked for, but torch sees no GPU")
    return resolved


def autocast(device: torch.device, precision: Precision) -> contextlib.AbstractContextManager:
    """Mixed precision for `precision` on `device`; float32 needs no context. fp16 needs a GPU."""
    if precision == "float32":
        return contextlib.nullcontext()
    if precision not in _AUTOCAST_TYPES:
        raise SettingError(f"unknown precision {precision!r}: expected float32, bf16 or fp16")
    if precision == "fp16" and device.type != "cuda":
        raise SettingError("fp16 needs a GPU; use bf16 or float32 on the CPU")
    return torch.autocast(device_type=device.type, dtype=_AUTOCAST_TYPES[precision])


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; from the CPU to a GPU through pinned memory, without waiting: a copy from
    ordinary (pageable) memory first waits for every kernel queued on the GPU, so that a training step
    that moved its batch that way would wait for the step before it."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# Where bf16 was measured to beat float32 on a CPU (docs/performance.md): AVX512-BF16 or AMX; elsewhere
# torch emulates bf16 and it is slower than float32.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The instruction-set flags the CPU lists (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def fastest_precision(device: torch.device, flags: set[str] | None = None) -> tuple[Precision, str]:
    """The inference precision measured to be fastest while keeping quality on `device`, and why: bf16 on
    a GPU that has it or a CPU with AVX512-BF16 or AMX (`flags`, default this CPU's), else float32."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "the GPU computes in bf16"
        return "float32", "the GPU lacks bf16"
    if device.type != "cpu":
        return "float32", f"no bf16 measurement on {device.type}"
    present = cpu_flags() if flags is None else flags
    found = [flag for flag in BF16_CPU_FLAGS if flag in present]
    if found:
        return "bf16", f"the CPU has {found[0]}"
    return "float32", "the CPU has neither AVX512-BF16 nor AMX, where bf16 is slower than float32"
