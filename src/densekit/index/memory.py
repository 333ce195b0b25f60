"""Whether an index will fit: the memory a build needs, from its spec alone, against what the machine has
available, so that one that cannot fit is refused before hours of work rather than killed during it."""

from __future__ import annotations

import math
import os
from pathlib import Path

from densekit.errors import DensekitError
from densekit.index.spec import IndexSpec

_FLOAT = 4
_ID = 8  # an IVF list keeps each vector's 64-bit id beside its code
_HNSW_NODE = 8 + 4  # HNSW's offset (64-bit) and level (32-bit) per vector


class IndexTooLarge(DensekitError, ValueError):
    """An index whose build needs more memory than is available."""


def index_bytes(spec: IndexSpec, rows: int, dimension: int) -> int:
    """The bytes the built index of a resolved `spec` holds in memory over `rows` vectors of `dimension`.

    flat: the vectors; hnsw: the vectors and the graph (2·M neighbours a vector on level 0, about one
    more on the levels above, 32 bits each); ivfpq: each vector's code and id, the coarse centroids and
    the product quantiser's centroids, and with re-ranking (`refine_k_factor`) every vector whole.
    """
    vectors = rows * dimension * _FLOAT
    if spec.type == "flat":
        return vectors
    if spec.type == "hnsw":
        return vectors + rows * ((2 * spec.hnsw_m + 1) * 4 + _HNSW_NODE)
    assert spec.nlist is not None and spec.pq_m is not None and spec.pq_bits is not None, "spec not resolved"
    code = math.ceil(spec.pq_m * spec.pq_bits / 8)
    centroids = spec.nlist * dimension * _FLOAT + 2**spec.pq_bits * dimension * _FLOAT
    return rows * (code + _ID) + centroids + refine_bytes(spec, rows, dimension)


def refine_bytes(spec: IndexSpec, rows: int, dimension: int) -> int:
    """What IVF-PQ's re-ranking with the exact vectors adds to its index: every vector whole."""
    return vectors_bytes(rows, dimension) if spec.refine_k_factor is not None else 0


def vectors_bytes(rows: int, dimension: int) -> int:
    """The bytes of `rows` float32 vectors of `dimension`."""
    return rows * dimension * _FLOAT


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


def amount(count: int) -> str:
    """Bytes for people: in GiB, or in MiB or KiB below a GiB."""
    units = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
    unit, size = next(((u, s) for u, s in units if count >= s), units[-1])
    return f"{count / size:.2f} {unit}"


def largest_part(spec: IndexSpec, rows: int, dimension: int) -> tuple[str, str]:
    """What makes a resolved `spec`'s index large, naming the option behind it, and what to choose
    instead."""
    vectors = rows * dimension * _FLOAT
    if spec.type == "flat":
        return f"it holds every vector whole ({amount(vectors)})", "choose ivfpq"
    if spec.type == "hnsw":
        graph = index_bytes(spec, rows, dimension) - vectors
        if graph > vectors:
            culprit = f"--hnsw-m {spec.hnsw_m} makes its graph {amount(graph)}"
            return culprit, "choose a smaller --hnsw-m or ivfpq"
        return f"it holds every vector whole ({amount(vectors)}) beside its graph", "choose ivfpq"
    assert spec.nlist is not None and spec.pq_m is not None and spec.pq_bits is not None, "spec not resolved"
    parts = [
        (rows * (math.ceil(spec.pq_m * spec.pq_bits / 8) + _ID),
         f"--pq-m {spec.pq_m} x --pq-bits {spec.pq_bits} make its codes", "a smaller --pq-m"),
        (spec.nlist * dimension * _FLOAT, f"--nlist {spec.nlist} makes its coarse centroids",
         "a smaller --nlist"),
        (2**spec.pq_bits * dimension * _FLOAT, f"--pq-bits {spec.pq_bits} makes its PQ centroids",
         "a smaller --pq-bits"),
    ]  # fmt: skip
    if spec.refine_k_factor is not None:
        culprit = f"re-ranking (refine k_factor {spec.refine_k_factor}) keeps every vector whole"
        parts.append((vectors, culprit, "a lower --target-recall, a larger --pq-m"))
    size, culprit, smaller = max(parts, key=lambda part: part[0])
    return f"{culprit} {amount(size)}", f"choose {smaller}"


def check_fits(spec: IndexSpec, rows: int, dimension: int, add_batch: int, training_rows: int) -> int:
    """Raise `IndexTooLarge` when building a resolved `spec` over `rows` vectors needs more memory than is
    available, naming the option that makes it large; returns the bytes it needs."""
    needed = build_bytes(spec, rows, dimension, add_batch, training_rows)
    available, source = available_memory()
    if needed > available:
        culprit, advice = largest_part(spec, rows, dimension)
        raise IndexTooLarge(
            f"a {spec.type} index of {rows} x {dimension} vectors needs about {needed} bytes ({gib(needed)}) "
            f"to build; {available} bytes ({gib(available)}) are available ({source}): {culprit}; {advice}, "
            "free memory, or pass --no-memory-check to build it anyway"
        )
    return needed
