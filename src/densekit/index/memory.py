"""Whether an index will fit: the memory a build needs, from its spec alone, against what the machine has
available, so that one that cannot fit is refused before hours of work rather than killed during it."""

from __future__ import annotations

import math
import os
from pathlib import Path

from densekit.index.spec import IndexSpec

_FLOAT = 4
_ID = 8  # an IVF list keeps each vector's 64-bit id beside its code
_HNSW_NODE = 8 + 4  # HNSW's offset (64-bit) and level (32-bit) per vector


class IndexTooLarge(ValueError):
    """An index whose build needs more memory than is available."""


def index_bytes(spec: IndexSpec, rows: int, dimension: int) -> int:
    """The bytes the built index of a resolved `spec` holds in memory over `rows` vectors of `dimension`.

    flat: the vectors; hnsw: the vectors and the graph (2·M neighbours a vector on level 0, about one
    more on the levels above, 32 bits each); ivfpq: each vector's code and id, the coarse centroids and
    the product quantiser's centroids.
    """
    vectors = rows * dimension * _FLOAT
    if spec.type == "flat":
        return vectors
    if spec.type == "hnsw":
        return vectors + rows * ((2 * spec.hnsw_m + 1) * 4 + _HNSW_NODE)
    assert spec.nlist is not None and spec.pq_m is not None and spec.pq_bits is not None, "spec not resolved"
    code = math.ceil(spec.pq_m * spec.pq_bits / 8)
    centroids = spec.nlist * dimension * _FLOAT + 2**spec.pq_bits * dimension * _FLOAT
    return rows * (code + _ID) + centroids


def build_bytes(spec: IndexSpec, rows: int, dimension: int, add_batch: int, training_rows: int) -> int:
    """The most memory a build of a resolved `spec` needs: the index, plus one batch of vectors being
    added and, for a type that trains, its training sample."""
    batch = min(rows, add_batch) * dimension * _FLOAT
    sample = training_rows * dimension * _FLOAT if spec.type == "ivfpq" else 0
    return index_bytes(spec, rows, dimension) + batch + sample


def available_memory() -> tuple[int, str]:
    """The bytes this process may still take, and where that figure comes from: the kernel's
    MemAvailable, or the cgroup's limit less its use where that is lower."""
    figures = []
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                figures.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    limit, used = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    if limit.is_file() and used.is_file() and limit.read_text().strip() != "max":
        left = int(limit.read_text()) - int(used.read_text())
        figures.append((left, "the cgroup's memory.max less memory.current"))
    if not figures:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        figures.append((pages, "free physical pages (sysconf)"))
    return min(figures)


def gib(count: int) -> str:
    """Bytes in GiB, for people."""
    return f"{count / 2**30:.2f} GiB"


def check_fits(spec: IndexSpec, rows: int, dimension: int, add_batch: int, training_rows: int) -> int:
    """Raise `IndexTooLarge` when building a resolved `spec` over `rows` vectors needs more memory than is
    available; returns the bytes it needs."""
    needed = build_bytes(spec, rows, dimension, add_batch, training_rows)
    available, source = available_memory()
    if needed > available:
        smaller = "a smaller --pq-m" if spec.type == "ivfpq" else "ivfpq"
        raise IndexTooLarge(
            f"a {spec.type} index of {rows} x {dimension} vectors needs about {needed} bytes ({gib(needed)}) "
            f"to build; {available} bytes ({gib(available)}) are available ({source}): choose {smaller}, "
            "free memory, or pass --no-memory-check to build it anyway"
        )
    return needed
