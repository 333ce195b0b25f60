"""What kind of Faiss index to build, with its parameters."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

IndexType = Literal["flat", "hnsw", "ivfpq"]

# Faiss's k-means wants at least this many training points per centroid.
MIN_POINTS_PER_CENTROID = 39


class IndexSpec(BaseModel):
    """An index type and its parameters; a None parameter is chosen from the corpus at build time.

    All types score by inner product (cosine similarity for normalised embeddings).
    """

    model_config = ConfigDict(extra="forbid")

    type: IndexType = "flat"
    hnsw_m: int = Field(32, gt=0, description="HNSW: neighbours per node")
    ef_construction: int = Field(200, gt=0, description="HNSW: candidate list size while building")
    ef_search: int = Field(256, gt=0, description="HNSW: candidate list size while searching")
    nlist: int | None = Field(None, gt=0, description="IVF: inverted lists (default 4·sqrt(n), capped)")
    nprobe: int = Field(32, gt=0, description="IVF: lists visited per query")
    pq_m: int | None = Field(None, gt=0, description="PQ: sub-quantisers (default dimension/4)")
    pq_bits: int | None = Field(
        None, ge=1, le=16, description="PQ: bits per code (default 8, fewer for small corpora)"
    )

    def resolved(self, rows: int, dimension: int) -> IndexSpec:
        """This spec with every automatic parameter chosen for `rows` vectors of `dimension`."""
        if self.type != "ivfpq":
            return self
        nlist = self.nlist or max(1, min(int(4 * math.sqrt(rows)), rows // MIN_POINTS_PER_CENTROID))
        pq_m = self.pq_m or _largest_divisor_at_most(dimension, max(1, dimension // 4))
        if dimension % pq_m:
            raise ValueError(f"pq_m={pq_m} must divide the dimension {dimension}")
        pq_bits = self.pq_bits or max(1, min(8, int(math.log2(max(2, rows // MIN_POINTS_PER_CENTROID)))))
        return self.model_copy(update={"nlist": nlist, "pq_m": pq_m, "pq_bits": pq_bits})

    def factory_string(self) -> str:
        """The `faiss.index_factory` description of a resolved spec."""
        if self.type == "flat":
            return "Flat"
        if self.type == "hnsw":
            return f"HNSW{self.hnsw_m},Flat"
        return f"IVF{self.nlist},PQ{self.pq_m}x{self.pq_bits}"


def _largest_divisor_at_most(number: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if number % d == 0)
