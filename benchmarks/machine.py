"""What a benchmark ran on, recorded beside its results."""

from __future__ import annotations

import datetime
import os
import platform
from importlib import metadata

from densekit.device import cpu_flags


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# The instruction sets that decide which inference path pays: int8 needs VNNI and bf16 needs AVX512-BF16
# or AMX to run faster than float32 (two "AMD EPYC" machines of this project differ in exactly these).
SPEED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def _cpu_flags() -> list[str]:
    """Which of SPEED_FLAGS the CPU lists (Linux's /proc/cpuinfo; empty elsewhere)."""
    present = cpu_flags()
    return [flag for flag in SPEED_FLAGS if flag in present]


def machine_info() -> dict:
    """CPU, core count, memory, GPU and library versions of this machine."""
    import torch

    versions = {}
    for package in (
        "densekit",
        "torch",
        "transformers",
        "sentence-transformers",
        "faiss-cpu",
        "bm25s",
        "numpy",
    ):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(memory, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "versions": versions,
    }
