"""What kind of Faiss index to build, with its parameters."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from densekit.errors import DensekitError

IndexType = Literal["flat", "hnsw", "ivfpq"]

# Faiss's k-means wants at least this many training points per centroid.
MIN_POINTS_PER_CENTROID = 39
# The fewest vectors IVF-PQ trains on (a uniform sample of them, or all where there are fewer); IVF cannot
# have more lists.
MAX_TRAINING_POINTS = 256 * 1024
# The training vectors drawn per inverted list where that is more than MAX_TRAINING_POINTS: faiss warns
# under 39 (MIN_POINTS_PER_CENTROID); 64 leaves a margin at a sample of 1.1 GiB for 8.8M 384-d vectors.
TRAINING_POINTS_PER_LIST = 64
# HNSW: faiss builds no graph levels with M = 1 (and crashes adding to it); past 1024 neighbours a node
# the graph outweighs the vectors it links (8 KiB a vector), and a flat index searches them exactly.
MAX_HNSW_M = 1024
# Faiss keeps a candidate list of ef entries per search or insertion, as a 32-bit int (a larger value
# wraps to a negative one); 65536 already visits more nodes than any recall needs.
MAX_EF = 65536
# The fewest vectors IVF-PQ trains on: its product quantisers' codes of one bit need two centroids.
MIN_IVFPQ_ROWS = 2 * MIN_POINTS_PER_CENTROID


class SpecError(DensekitError, ValueError):
    """An index parameter that cannot be used, named by its field (`nlist`, `pq_bits`)."""

    def __init__(self, field: str, value: Any, reason: str):
        super().__init__(f"{field}={value}: {reason}")
        self.field = field
        self.value = value
        self.reason = reason

    @property
    def option(self) -> str:
        """The command line's name for the field (`--pq-bits` for `pq_bits`)."""
        return "--" + self.field.replace("_", "-")


class IndexSpec(BaseModel):
    """Faiss: flat (exact search), HNSW or IVF-PQ, by inner product (cosine similarity for normalised
    embeddings), saved in one file; a None parameter is chosen from the corpus at build time."""

    model_config = ConfigDict(extra="forbid")

    type: IndexType = "flat"
    hnsw_m: int = Field(32, ge=2, le=MAX_HNSW_M, description="HNSW: neighbours per node")
    ef_construction: int = Field(200, gt=0, le=MAX_EF, description="HNSW: candidate list size while building")
    ef_search: int = Field(256, gt=0, le=MAX_EF, description="HNSW: candidate list size while searching")
    nlist: int | None = Field(
        None, gt=0, le=MAX_TRAINING_POINTS, description="IVF: inverted lists (default 4·sqrt(n), capped)"
    )
    refine_k_factor: int | None = Field(
        None, gt=0, le=MAX_EF,
        description="IVF-PQ: re-rank k x this many candidates with the exact vectors (None: no re-ranking)",
    )
    nprobe: int = Field(
        32, gt=0, le=MAX_TRAINING_POINTS, description="IVF: lists visited per query (at most nlist are)"
    )
    pq_m: int | None = Field(None, gt=0, le=65536, description="PQ: sub-quantisers (default dimension/4)")
    pq_bits: int | None = Field(
        None, ge=1, le=16, description="PQ: bits per code (default 8, fewer for small corpora)"
    )

    @classmethod
    def checked(cls, **values: Any) -> IndexSpec:
        """A spec from `values`, raising `SpecError` naming the first parameter out of its bounds."""
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            raise SpecError(field, values.get(field), first["msg"]) from None

    def updated(self, **values: Any) -> IndexSpec:
        """This spec with `values` replaced (None keeps the current value), checked as `checked` does."""
        given = {key: value for key, value in values.items() if value is not None}
        return type(self).checked(**{**self.model_dump(), **given})

    def resolved(self, rows: int, dimension: int) -> IndexSpec:
        """This spec with every automatic parameter chosen for `rows` vectors of `dimension`.

        Automatic IVF-PQ parameters give Faiss's k-means at least `MIN_POINTS_PER_CENTROID` vectors of its
        training sample (`training_rows`) per centroid, for the inverted lists and for each
        sub-quantiser's codes; given ones that Faiss cannot train with raise `SpecError`.
        """
        if self.type != "ivfpq":
            if self.refine_k_factor is not None:
                reason = "only ivfpq indexes re-rank candidates"
                raise SpecError("refine_k_factor", self.refine_k_factor, reason)
            return self
        if rows < MIN_IVFPQ_ROWS:
            raise SpecError(
                "type", self.type, f"IVF-PQ needs at least {MIN_IVFPQ_ROWS} vectors to train its quantisers "
                f"({MIN_POINTS_PER_CENTROID} per centroid), not {rows}; use flat for so few"
            )  # fmt: skip
        nlist = self.nlist or max(1, min(int(4 * math.sqrt(rows)), rows // MIN_POINTS_PER_CENTROID))
        trained = training_rows(rows, nlist)
        if nlist > trained:
            reason = f"more inverted lists than the {trained} vectors to train them on"
            raise SpecError("nlist", nlist, reason)
        pq_m = self.pq_m or _largest_divisor_at_most(dimension, max(1, dimension // 4))
        if dimension % pq_m:
            raise SpecError("pq_m", pq_m, f"sub-quantisers must divide the dimension {dimension}")
        pq_bits = self.pq_bits or max(1, min(8, int(math.log2(trained // MIN_POINTS_PER_CENTROID))))
        if 2**pq_bits > rows:
            raise SpecError(
                "pq_bits", pq_bits, f"{2**pq_bits} centroids per sub-quantiser, more than the {rows} vectors "
                "to train them on"
            )  # fmt: skip
        return self.model_copy(update={"nlist": nlist, "pq_m": pq_m, "pq_bits": pq_bits})

    def factory_string(self) -> str:
        """The `faiss.index_factory` description of a resolved spec."""
        if self.type == "flat":
            return "Flat"
        if self.type == "hnsw":
            return f"HNSW{self.hnsw_m},Flat"
        refine = ",RFlat" if self.refine_k_factor is not None else ""
        return f"IVF{self.nlist},PQ{self.pq_m}x{self.pq_bits}{refine}"


def training_rows(rows: int, nlist: int, floor: int = MAX_TRAINING_POINTS) -> int:
    """How many of `rows` vectors IVF-PQ with `nlist` lists trains on: `TRAINING_POINTS_PER_LIST` a list,
    and at least `floor`, or every row where there are fewer."""
    return min(rows, max(floor, TRAINING_POINTS_PER_LIST * nlist))


def _largest_divisor_at_most(number: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if number % d == 0)
