"""Binary and int8 indexes: the vectors' coarse codes in memory, their top candidates rescored against a
finer copy of the vectors kept on disk.

binary: one bit a dimension, its sign (1 where the value is above 0, as sentence-transformers'
`quantize_embeddings` makes 'ubinary' codes), packed 8 to a byte and searched by Hamming distance in one
of faiss's binary indexes: `IndexBinaryFlat` (every code), or `IndexBinaryHNSW` or `IndexBinaryIVF` for
large collections. A query is binarized the same way; without rescoring, a code's score is the inner
product of the two sign vectors, bits - 2 x Hamming distance. With `code_bits` N the codes are the signs
of the vectors projected to N dimensions (a PCA fitted on a sample of the corpus, followed by a random
rotation that spreads its variance over every bit; `projection.npy`), so that fewer bits than dimensions
keep most of what the signs say: in a binary IVF index, whose lists hold each code's 8-byte id beside
it, 312 bits (39 bytes) keep a vector within the 48 bytes of a 384-dimensional one's 1/32.

A binary IVF index's lists have binary centroids by default (faiss's `IndexBinaryIVF`, k-means over the
codes, a query's lists those nearest its code). With `ivf_centroids` int8 the centroids are k-means over
the float vectors (`centroids.npy`), held in memory as 8-bit codes (faiss's scalar quantiser, a byte a
dimension), and a vector's list and a query's lists are those whose centroids have the largest inner
product with the float vector: lists that group near vectors better, so fewer are probed for the same
recall (docs/compression.md measures both at wiki1m's 1M).

int8: one byte a dimension, faiss's scalar quantiser (`IndexScalarQuantizer`, `QT_8bit`), searched with
the float query.

The calibration of 8-bit codes is each dimension's range, its minimum and maximum over the whole corpus
(no value is clipped), recorded in `index.json` and the manifest. With `rescore` N, a search for k
results takes the top N x k candidates from the codes and scores them with the float query against
`rescore.npy`: 8-bit codes of the same calibration (`rescore_with` int8, binary's default) or the float32
vectors (int8's), memory-mapped: RAM holds only the coarse codes, and the copy's pages are read as
candidates need them. `densekit index --target-recall` chooses the smallest rescoring depth (and, for a
binary HNSW or IVF index, `ef_search` or `nprobe`) meeting the target, as for faiss's approximate types.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from densekit.data.hits import Hits
from densekit.diagnostics import DataError, Problem
from densekit.encoding.store import EmbeddingStore
from densekit.index import recall as recall_module
from densekit.index.base import (
    IDS_FILE,
    META_FILE,
    BuildOptions,
    SearchIndex,
    check_finite_rows,
    check_output,
    index_folder,
    index_identity,
    write_ids,
)
from densekit.index.memory import IndexTooLarge, amount, available_memory
from densekit.index.recall import Chosen, RecallSettings, gather_rows
from densekit.index.spec import (
    MAX_EF,
    MAX_HNSW_M,
    MAX_TRAINING_POINTS,
    MIN_POINTS_PER_CENTROID,
    SpecError,
    training_rows,
)
from densekit.io.fingerprint import write_digested
from densekit.progress import progress_bar

BACKEND = "quantized"
CODES_FILE = "codes.faiss"
RESCORE_FILE = "rescore.npy"
PROJECTION_FILE = "projection.npy"
CENTROIDS_FILE = "centroids.npy"
PROJECTION_SAMPLE = 64 * 1024  # rows the projection of `code_bits` is fitted on
MAX_CODE_BITS = 65536
MAX_RESCORE = 64  # the deepest rescoring a target tries, as IVF-PQ's re-ranking (recall.MAX_K_FACTOR)
_HNSW_NODE = 8 + 4  # HNSW's offset (64-bit) and level (32-bit) per vector
_ID = 8  # an IVF list keeps each code's 64-bit id beside it
_COPY_BYTES = {"int8": 1, "float32": 4}


class QuantizedSpec(BaseModel):
    """binary or int8: each vector as one bit a dimension (its sign; Hamming distance) or one byte
    (faiss's scalar quantiser, ranges from the corpus), held in memory; with --rescore N the top N x k
    candidates are rescored with the float query against a finer copy of the vectors kept on disk."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["binary", "int8"] = "binary"
    rescore: int | None = Field(
        None,
        ge=1,
        le=MAX_RESCORE,
        description="rescore the top N x k candidates against the copy on disk (none without; "
        "--target-recall chooses it)",
    )
    rescore_with: Literal["int8", "float32"] | None = Field(
        None, description="the copy on disk: int8 (8-bit codes; binary's default) or float32 (int8's)"
    )
    binary_index: Literal["flat", "hnsw", "ivf"] | None = Field(
        None, description="binary: faiss's flat (every code; the default), hnsw or ivf index of the codes"
    )
    code_bits: int | None = Field(
        None, ge=8, le=MAX_CODE_BITS, description="binary: bits a code, the signs of the vectors projected "
        "to that many dimensions (PCA over the corpus, randomly rotated; a multiple of 8, at most the "
        "dimension); none: one a dimension, the vectors' own signs"
    )
    hnsw_m: int = Field(32, ge=2, le=MAX_HNSW_M, description="binary hnsw: neighbours per node")
    ef_construction: int = Field(
        200, gt=0, le=MAX_EF, description="binary hnsw: candidate list while building"
    )
    ef_search: int = Field(256, gt=0, le=MAX_EF, description="binary hnsw: candidate list while searching")
    nlist: int | None = Field(
        None, gt=0, le=MAX_TRAINING_POINTS, description="binary ivf: inverted lists (4·sqrt(n), capped)"
    )
    nprobe: int = Field(32, gt=0, le=MAX_TRAINING_POINTS, description="binary ivf: lists visited per query")
    ivf_centroids: Literal["binary", "int8"] | None = Field(
        None, description="binary ivf: the lists' centroids, binary (k-means over the codes; the default) "
        "or int8 (k-means over the float vectors, held as 8-bit codes; a query's lists chosen with its "
        "float vector: fewer probed for the same recall)"
    )

    def resolved(self, rows: int, targeted: bool) -> QuantizedSpec:
        """This spec with what it leaves to the corpus chosen for `rows` vectors (`targeted`: a recall
        target will choose the rescoring depth), or a `SpecError` naming a setting that cannot be used."""
        if self.type == "int8" and self.binary_index is not None:
            raise SpecError("binary_index", self.binary_index, "an int8 index is a flat scalar-quantised one")
        if self.type == "int8" and self.code_bits is not None:
            raise SpecError("code_bits", self.code_bits, "an int8 index holds one byte a dimension")
        if self.code_bits is not None and self.code_bits % 8:
            raise SpecError("code_bits", self.code_bits, "codes are whole bytes: give a multiple of 8")
        copy = self.rescore_with or ("int8" if self.type == "binary" else "float32")
        if self.type == "int8" and copy == "int8":
            reason = "an int8 index's codes are already int8: rescore with float32"
            raise SpecError("rescore_with", self.rescore_with, reason)
        if targeted and self.rescore is not None:
            reason = "--target-recall chooses the rescoring depth: give one of them"
            raise SpecError("rescore", self.rescore, reason)
        rescoring = targeted or self.rescore is not None
        if self.rescore_with is not None and not rescoring:
            reason = "nothing is rescored: give --rescore N (or --target-recall) as well"
            raise SpecError("rescore_with", self.rescore_with, reason)
        structure = (self.binary_index or "flat") if self.type == "binary" else None
        if self.ivf_centroids is not None and structure != "ivf":
            raise SpecError("ivf_centroids", self.ivf_centroids, "only a binary ivf index has centroids")
        nlist, centroids = None, None
        if structure == "ivf":
            centroids = self.ivf_centroids or "binary"
            nlist = self.nlist or max(1, min(int(4 * math.sqrt(rows)), rows // MIN_POINTS_PER_CENTROID))
            if nlist > rows:
                raise SpecError(
                    "nlist", nlist, f"more inverted lists than the {rows} vectors to train them on"
                )
        update = {"rescore_with": copy if rescoring else None, "binary_index": structure, "nlist": nlist,
                  "ivf_centroids": centroids}  # fmt: skip
        return self.model_copy(update=update)

    @property
    def search_parameter(self) -> str | None:
        """The search parameter of the index of the codes: `ef_search` (binary hnsw), `nprobe` (binary
        ivf), or none."""
        return {"hnsw": "ef_search", "ivf": "nprobe"}.get(self.binary_index or "")


def binarize(vectors: np.ndarray, bits: int | None = None) -> np.ndarray:
    """Each vector's sign bits (1 where a value is above 0), packed 8 to a byte, first dimension in the
    highest bit, padded with 0 to `bits` (a multiple of 8; by default the dimension rounded up)."""
    dimension = vectors.shape[1]
    bits = bits or 8 * math.ceil(dimension / 8)
    signs = np.zeros((len(vectors), bits), dtype=bool)
    signs[:, :dimension] = np.asarray(vectors) > 0
    return np.packbits(signs, axis=1)


class BinaryCoder:
    """Vectors as binary codes of `bits` bits: their signs (`binarize`), or the signs of their projection
    (`matrix` x vector + `bias`, `bits` rows) where the index was built with `code_bits`."""

    def __init__(self, bits: int, projection: np.ndarray | None = None):
        self.bits = bits
        self.transform = None  # the projection, held once: by faiss
        if projection is not None:
            # applied by faiss, whose matrix product shares faiss's OpenMP threads: numpy's BLAS threads
            # spin beside them, which halved the queries a second of 32-query calls on two threads
            self.transform = faiss.LinearTransform(projection.shape[1] - 1, bits, True)
            faiss.copy_array_to_vector(np.ascontiguousarray(projection[:, :-1]).ravel(), self.transform.A)
            faiss.copy_array_to_vector(np.ascontiguousarray(projection[:, -1]), self.transform.b)
            self.transform.is_trained = True

    @property
    def projection(self) -> np.ndarray | None:
        """The projection as saved, (bits, dimension + 1) float32: the matrix, its last column the bias
        (None for the vectors' own signs)."""
        if self.transform is None:
            return None
        matrix = faiss.vector_to_array(self.transform.A).reshape(self.bits, self.transform.d_in)
        return np.column_stack([matrix, faiss.vector_to_array(self.transform.b)]).astype(np.float32)

    def __call__(self, vectors: np.ndarray) -> np.ndarray:
        """The codes of `vectors`, (rows, bits / 8) bytes."""
        if self.transform is None:
            return binarize(vectors, self.bits)
        return binarize(self.transform.apply(np.ascontiguousarray(vectors, dtype=np.float32)), self.bits)

    @classmethod
    def fitted(cls, sample: np.ndarray, bits: int) -> BinaryCoder:
        """The coder of `bits` bits fitted on `sample` (float32 rows): faiss's PCA to `bits` dimensions
        with a random rotation after it, so that every bit carries a like share of the variance (the
        signs of the leading components alone would spend bits on the least of it)."""
        pca = faiss.PCAMatrix(sample.shape[1], bits, 0.0, True)
        pca.train(np.ascontiguousarray(sample, dtype=np.float32))
        matrix = faiss.vector_to_array(pca.A).reshape(bits, sample.shape[1])
        bias = faiss.vector_to_array(pca.b)
        return cls(bits, np.column_stack([matrix, bias]).astype(np.float32))


def calibrate(
    chunks: recall_module.Chunks, dimension: int, check: Callable[[int, np.ndarray], None]
) -> np.ndarray:
    """Each dimension's minimum and maximum over every row of `chunks` ((2, dimension), float32): the
    ranges of 8-bit codes, so that no value is clipped. `check` is given each chunk first."""
    low = np.full(dimension, np.inf, dtype=np.float32)
    high = np.full(dimension, -np.inf, dtype=np.float32)
    for first, vectors in chunks():
        check(first, vectors)
        low = np.minimum(low, vectors.min(axis=0))
        high = np.maximum(high, vectors.max(axis=0))
    return np.stack([low, high])


def scalar_quantizer(ranges: np.ndarray) -> faiss.ScalarQuantizer:
    """faiss's 8-bit scalar quantiser over `ranges` (`calibrate`), trained with them as they are."""
    quantizer = faiss.ScalarQuantizer(ranges.shape[1], faiss.ScalarQuantizer.QT_8bit)
    faiss.copy_array_to_vector(_trained(ranges), quantizer.trained)
    return quantizer


def _trained(ranges: np.ndarray) -> np.ndarray:
    """What faiss's 8-bit scalar quantiser holds as trained for `ranges`: each dimension's minimum,
    then its width."""
    width = np.maximum(ranges[1] - ranges[0], np.finfo(np.float32).tiny)  # a constant dimension
    return np.concatenate([ranges[0], width]).astype(np.float32)


def ram_bytes(spec: QuantizedSpec, rows: int, dimension: int) -> int:
    """The bytes the index of a resolved `spec` holds in memory: the codes (one bit or one byte a
    dimension, or `code_bits` bits and their projection), with a binary HNSW's graph or a binary IVF's
    ids and centroids (binary codes, or int8 ones and their scalar quantiser's ranges); not the copy on
    disk."""
    code = _code_bits(spec, dimension) // 8 if spec.type == "binary" else dimension
    projection = spec.code_bits * (dimension + 1) * 4 if spec.code_bits else 0
    if spec.binary_index == "hnsw":
        return rows * (code + (2 * spec.hnsw_m + 1) * 4 + _HNSW_NODE) + projection
    if spec.binary_index == "ivf":
        assert spec.nlist is not None, "spec not resolved"
        centroids = spec.nlist * code
        if spec.ivf_centroids == "int8":
            centroids = spec.nlist * dimension + 2 * dimension * 4  # each a byte a dimension, and the ranges
        return rows * (code + _ID) + centroids + projection
    return rows * code + projection


def _code_bits(spec: QuantizedSpec, dimension: int) -> int:
    """The bits of a binary code: `code_bits`, or one a dimension rounded up to whole bytes."""
    return spec.code_bits or 8 * math.ceil(dimension / 8)


def copy_bytes(spec: QuantizedSpec, rows: int, dimension: int) -> int:
    """The bytes of the copy on disk (none without rescoring)."""
    return rows * dimension * _COPY_BYTES[spec.rescore_with] if spec.rescore_with else 0


class QuantizedIndex(SearchIndex, backend=BACKEND):
    """Binary or int8 codes in memory (`codes.faiss`), rescored against the copy on disk (`rescore.npy`)."""

    types = ("binary", "int8")
    spec_class = QuantizedSpec

    def __init__(
        self,
        index: faiss.Index | faiss.IndexBinary,
        copy: np.ndarray | None,
        ids: list[str],
        meta: dict[str, Any],
        folder: Path,
        identity: dict[str, Any] | None = None,
        projection: np.ndarray | None = None,
        lists: faiss.IndexScalarQuantizer | None = None,
    ):
        self.index = index  # the codes
        self.coder = BinaryCoder(index.d, projection) if isinstance(index, faiss.IndexBinary) else None
        self.lists = lists  # a binary IVF's int8 centroids, choosing lists for float vectors (None: its own)
        self.copy = copy  # the finer copy, memory-mapped (None without rescoring)
        self.ids = np.asarray(ids, dtype=object)
        self.meta = meta
        self.folder = folder
        self.identity = identity
        self.spec = QuantizedSpec(**meta["spec"])
        calibration = meta.get("calibration")
        self.ranges = (
            None if calibration is None else np.array([calibration["low"], calibration["high"]], np.float32)
        )
        self.quantizer = None if self.ranges is None else scalar_quantizer(self.ranges)
        self.set_search_parameters()

    @classmethod
    def build(cls, store: EmbeddingStore, spec: QuantizedSpec, output: Path, options: BuildOptions) -> Path:
        """Build the codes of `spec` over `store` (and its copy on disk, to rescore with) and save them
        atomically to `output`: the calibration is read in one pass over the vectors, the codes and the
        copy written in a second, a batch at a time, so memory holds the codes and one batch. With
        `options.recall` the recall@10 and @100 against exact search are measured and recorded, and a
        target chooses the smallest rescoring depth (and `ef_search` or `nprobe`) meeting it."""
        rows, dimension = len(store), store.dimension
        if rows == 0:
            raise DataError([Problem(store.folder, None, "no embeddings to index")])
        recall = options.recall
        target = recall.target if recall is not None else None
        spec = spec.resolved(rows, target is not None)
        identity = index_identity(store, spec)  # as asked: a target's choice is in `index.json`
        if recall is not None and recall.identity() is not None:
            identity["recall_target"] = recall.identity()
        check_output(output, store, identity, options.overwrite)
        if options.check_memory:
            _check_fits(spec, rows, dimension, options.add_batch)
        chunks = recall_module.chunk_reader(store.parts, options.add_batch)
        checks = _finite_checks(store)
        ranges = None
        if spec.type == "int8" or spec.rescore_with == "int8":
            ranges = calibrate(chunks, dimension, checks)
        about: dict[str, Any] = {**store.about, "embeddings": str(store.folder)}
        meta: dict[str, Any] = {"spec": spec.model_dump(), "rows": rows, "dimension": dimension,
                                "maxp": store.maxp, "backend": BACKEND}  # fmt: skip
        if ranges is not None:
            meta["calibration"] = about["calibration"] = {
                "method": f"each dimension's minimum and maximum over the {rows} vectors",
                "low": ranges[0].tolist(), "high": ranges[1].tolist(),
            }  # fmt: skip
        coder = _coder(spec, dimension, chunks, rows, options.seed) if spec.type == "binary" else None
        projection = coder.projection if coder is not None else None
        if projection is not None:
            about["projection"] = (f"PCA to {coder.bits} dimensions over {min(rows, PROJECTION_SAMPLE)} "
                                   f"vectors drawn with seed {options.seed}, randomly rotated")  # fmt: skip
        digests: dict[str, str] = {}
        with index_folder(output, identity, about, options.overwrite, digests) as tmp:
            index, centroids = _empty_index(spec, coder, ranges, chunks, rows, options.seed)
            lists = None if centroids is None else centroid_lists(centroids)
            copy_path = tmp / RESCORE_FILE
            with progress_bar(f"indexing ({spec.type})", rows, options.show_progress) as advance:
                fill = _filler(index, spec, coder, lists, rows, dimension, ranges, chunks, checks, advance)
                if spec.rescore_with is None:
                    fill(lambda block: None)
                else:
                    digests[RESCORE_FILE] = write_digested(copy_path, fill)
            copy = np.load(copy_path, mmap_mode="r") if spec.rescore_with else None
            searcher = cls(index, copy, store.ids(), meta, tmp, projection=projection, lists=lists)
            if recall is not None:
                chosen, about["recall"] = _measure(searcher, store, recall, chunks, options.show_progress)
                meta["spec"] = chosen.model_dump()
                if chosen.rescore is None and copy is not None:  # the codes alone met the target
                    del copy, searcher
                    copy_path.unlink()
                    digests.pop(RESCORE_FILE)
                    meta["spec"] = chosen.model_copy(update={"rescore_with": None}).model_dump()
            writer = faiss.write_index_binary if spec.type == "binary" else faiss.write_index
            writer(index, str(tmp / CODES_FILE))
            write_ids(store, tmp / IDS_FILE)
            if projection is not None:
                np.save(tmp / PROJECTION_FILE, projection)
            if centroids is not None:
                np.save(tmp / CENTROIDS_FILE, centroids)
                sampled = training_rows(rows, spec.nlist)
                about["centroids"] = (f"spherical k-means of {spec.nlist} over {sampled} vectors drawn "
                                      f"with seed {options.seed}, held as int8")  # fmt: skip
            saved = QuantizedSpec(**meta["spec"])
            about["memory"] = _memory(saved, rows, dimension, tmp)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        return output

    @classmethod
    def summary(cls, meta: dict[str, Any], about: dict[str, Any]) -> str:
        """The recall measured and the setting saved, then the memory a vector takes in RAM and on disk."""
        memory = about["memory"]
        ram, disk = memory["ram_bytes_per_vector"], memory["disk_bytes_per_vector"]
        size = f"{ram:.1f} bytes a vector in RAM, {disk:.1f} on disk"
        words = recall_module.recall_words(about.get("recall"))
        return f"{words[:-1]}; {size})" if words else f" ({size})"

    @classmethod
    def open(
        cls, folder: Path, meta: dict[str, Any], ids: list[str], identity: dict[str, Any], gpu: bool,
        mmap: bool,
    ) -> QuantizedIndex:  # fmt: skip
        """The codes of `folder`, read into memory, and its copy memory-mapped (whatever `mmap` says:
        holding only the codes in RAM is the point); faiss searches binary and int8 codes on the CPU."""
        if gpu:
            reason = f"a {meta['spec']['type']} index is searched on the CPU: leave out --gpu-index"
            raise DataError([Problem(folder, None, reason)])
        reader = faiss.read_index_binary if meta["spec"]["type"] == "binary" else faiss.read_index
        try:
            index = reader(str(folder / CODES_FILE))
        except RuntimeError as err:
            reason = " ".join(str(err).split()).rsplit(": ", 1)[-1]
            raise DataError([Problem(folder / CODES_FILE, None, f"faiss cannot read it: {reason}")]) from None
        if len(ids) != index.ntotal:
            raise DataError([Problem(folder / IDS_FILE, None, f"{len(ids)} ids for {index.ntotal} vectors")])
        copy = None
        if meta["spec"].get("rescore_with"):
            copy = np.load(folder / RESCORE_FILE, mmap_mode="r")
            if copy.shape != (index.ntotal, meta["dimension"]):
                shape = f"holds {copy.shape}, not the {index.ntotal} x {meta['dimension']} of the codes"
                raise DataError([Problem(folder / RESCORE_FILE, None, shape)])
        projection = None
        if meta["spec"].get("code_bits"):
            projection = _read_array(folder / PROJECTION_FILE, (index.d, meta["dimension"] + 1))
        lists = None
        if meta["spec"].get("ivf_centroids") == "int8":
            if not isinstance(index, faiss.IndexBinaryIVF):
                found = f"holds a {type(index).__name__}, not a binary IVF index"
                raise DataError([Problem(folder / CODES_FILE, None, found)])
            lists = centroid_lists(_read_array(folder / CENTROIDS_FILE, (index.nlist, meta["dimension"])))
        return cls(index, copy, ids, meta, folder, identity, projection, lists)

    @property
    def dimension(self) -> int:
        """The indexed vectors' size."""
        return int(self.meta["dimension"])

    @property
    def rows(self) -> int:
        """Vectors held."""
        return int(self.index.ntotal)

    @property
    def mapped_file(self) -> Path | None:
        """The copy on disk, read as searches rescore candidates."""
        return self.folder / RESCORE_FILE if self.copy is not None else None

    def set_search_parameters(self, ef_search: int | None = None, nprobe: int | None = None) -> None:
        """Set a binary HNSW's candidate list or a binary IVF's lists probed (None: the spec's value); one
        the index has no use for, or out of bounds, raises `SpecError`."""
        used = self.spec.search_parameter
        given = {
            name: value for name, value in (("ef_search", ef_search), ("nprobe", nprobe)) if value is not None
        }
        for field, value in given.items():
            if field != used:
                kind = self.spec.type + (f" ({self.spec.binary_index})" if self.spec.binary_index else "")
                raise SpecError(field, value, f"{self.folder} is {kind}: it has no {field}")
        self.spec = type(self).spec_of({**self.spec.model_dump(), **given})
        if used == "nprobe":
            self.index.nprobe = min(self.spec.nprobe, self.index.nlist)

    def stored_vectors(self, doc_ids: list[str]) -> np.ndarray | None:
        """None: the index holds codes, not the vectors as searched."""
        return None

    def search(self, queries: np.ndarray, k: int) -> Hits:
        """The top `k` rows per query: the codes' best (`rescore` x `k` of them when rescoring), rescored
        against the copy on disk with the float query."""
        if queries.ndim != 2 or queries.shape[1] != self.dimension:
            raise ValueError(
                f"query vectors of shape {queries.shape}; the index holds dimension {self.dimension}"
            )
        if k < 1:
            raise ValueError(f"k={k}: at least one result per query must be asked for")
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        depth = min(k, max(1, self.rows))
        rescore = self.spec.rescore if self.copy is not None else None
        candidates = min(self.rows, depth * rescore) if rescore else depth
        scores, labels = self._coarse(queries, candidates)
        if rescore:
            scores, labels = self._rescored(queries, labels, depth)
        return Hits(scores, labels, self.ids)

    def _coarse(self, queries: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The codes' top `depth` rows per query and their scores (binary: the sign vectors' inner
        product, the signs less twice the Hamming distance; int8: faiss's inner product with the decoded
        codes). A binary IVF with int8 centroids probes the lists the float query picks."""
        if self.spec.type == "int8":
            return self.index.search(queries, depth)
        assert self.coder is not None, "a binary index has its coder"
        codes = self.coder(queries)
        if self.spec.binary_index == "hnsw":
            parameters = faiss.SearchParametersHNSW()
            parameters.efSearch = max(self.spec.ef_search, depth)  # faiss gives fewer from a shorter list
            distances, labels = self.index.search(codes, depth, params=parameters)
        elif self.lists is not None:
            _, probed = self.lists.search(queries, self.index.nprobe)
            distances, labels = self.index.search_preassigned(codes, depth, probed, None)
        else:
            distances, labels = self.index.search(codes, depth)
        signs = self.index.d if self.coder.transform is not None else self.dimension  # not the padding
        return (signs - 2 * distances).astype(np.float32), labels

    def _rescored(self, queries: np.ndarray, labels: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The best `depth` of each query's candidate rows (`labels`; -1 for none) by the float query's
        inner product with the copy on disk, read in file order; rows of equal score in row order."""
        scores = np.full((len(queries), depth), -np.inf, dtype=np.float32)
        rows = np.full((len(queries), depth), -1, dtype=np.int64)
        # the mapping indexed as a plain array, and faiss's rows (each once) sorted rather than made
        # unique: np.memmap's indexing and np.unique cost a quarter to a third of a query's rescoring
        copy = self.copy.view(np.ndarray)  # type: ignore[union-attr]
        for number, candidates in enumerate(labels):
            found = np.sort(candidates[candidates >= 0])  # the copy read in file order
            vectors = copy[found]
            if self.quantizer is not None and vectors.dtype == np.uint8:
                vectors = self.quantizer.decode(vectors)
            scored = vectors @ queries[number]
            best = np.lexsort((found, -scored))[:depth]
            scores[number, : len(best)], rows[number, : len(best)] = scored[best], found[best]
        return scores, rows


def _finite_checks(store: EmbeddingStore) -> Callable[[int, np.ndarray], None]:
    """A check of the rows of `store` from a row on (counted over every part), naming the part's file,
    the row and the document of the first that holds NaN or an infinity."""
    bounds = np.cumsum([0] + [int(part.meta["rows"]) for part in store.parts])

    def check(first: int, vectors: np.ndarray) -> None:
        part = int(np.searchsorted(bounds, first, side="right")) - 1
        found = store.parts[part]
        check_finite_rows(vectors, found.stem.with_suffix(".npy"), found.ids, first - int(bounds[part]))

    return check


def _check_fits(spec: QuantizedSpec, rows: int, dimension: int, add_batch: int) -> None:
    """Refuse, before any work, a build whose codes, one batch of vectors and any training sample need
    more memory than is available (the copy is written to disk, not held)."""
    ivf_sample = training_rows(rows, spec.nlist) if spec.nlist else 0
    sample = max(ivf_sample, min(rows, PROJECTION_SAMPLE) if spec.code_bits else 0) * dimension * 4
    needed = ram_bytes(spec, rows, dimension) + min(rows, add_batch) * dimension * 4 + sample
    available, source = available_memory()
    if needed > available:
        raise IndexTooLarge(
            f"a {spec.type} index of {rows} x {dimension} vectors needs about {amount(needed)} to build; "
            f"{amount(available)} are available ({source}): free memory, or pass --no-memory-check"
        )


def _coder(
    spec: QuantizedSpec, dimension: int, chunks: recall_module.Chunks, rows: int, seed: int
) -> BinaryCoder:
    """The binary codes of a resolved `spec`: the vectors' own signs, or with `code_bits` the signs of
    their projection fitted on a uniform sample of the rows (drawn with `seed`)."""
    if spec.code_bits is None:
        return BinaryCoder(_code_bits(spec, dimension))
    if spec.code_bits > dimension:
        reason = f"more bits than the vectors' {dimension} dimensions to project them to"
        raise SpecError("code_bits", spec.code_bits, reason)
    take = min(rows, PROJECTION_SAMPLE)
    chosen = np.sort(np.random.default_rng(seed).choice(rows, size=take, replace=False))
    return BinaryCoder.fitted(gather_rows(chunks(), chosen), spec.code_bits)


def _read_array(path: Path, shape: tuple[int, int]) -> np.ndarray:
    """The projection or the centroids a binary index saved (float32 of `shape`, finite), or a
    `DataError` naming the file and what is wrong with it. The header is checked before the array is
    read: a file claiming another size allocates nothing."""
    try:
        mapped = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DataError([Problem(path, None, f"cannot be read as a .npy array: {err}")]) from None
    if mapped.dtype != np.float32 or mapped.shape != shape:
        found = f"{mapped.dtype} of shape {mapped.shape}"
        raise DataError([Problem(path, None, f"holds {found}, not the float32 {shape} of the index")])
    array = np.array(mapped)  # read in, and the file let go
    del mapped
    if not np.isfinite(array).all():
        raise DataError([Problem(path, None, "holds NaN or an infinity")])
    return array


def _empty_index(
    spec: QuantizedSpec, coder: BinaryCoder | None, ranges: np.ndarray | None, chunks: recall_module.Chunks,
    rows: int, seed: int,
) -> tuple[faiss.Index | faiss.IndexBinary, np.ndarray | None]:  # fmt: skip
    """The empty index of the codes of a resolved `spec`: an int8 one calibrated with `ranges`, a binary
    one of `coder`'s codes (an IVF trained on a uniform sample of the rows, drawn with `seed`: on their
    codes, or with int8 centroids on the vectors); and an IVF's int8 centroids (float32; None else)."""
    if spec.type == "int8":
        assert ranges is not None, "an int8 index is calibrated"
        index = faiss.IndexScalarQuantizer(
            ranges.shape[1], faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT
        )
        faiss.copy_array_to_vector(_trained(ranges), index.sq.trained)
        index.is_trained = True  # with the corpus's ranges, as the copy's codes are
        return index, None
    assert coder is not None, "a binary index has its coder"
    bits = coder.bits
    if spec.binary_index == "hnsw":
        index = faiss.index_binary_factory(bits, f"BHNSW{spec.hnsw_m}")
        index.hnsw.efConstruction = spec.ef_construction
        return index, None
    if spec.binary_index == "ivf":
        assert spec.nlist is not None, "spec not resolved"
        take = training_rows(rows, spec.nlist)
        chosen = np.sort(np.random.default_rng(seed).choice(rows, size=take, replace=False))
        sample = gather_rows(chunks(), chosen)
        if spec.ivf_centroids == "int8":
            quantizer = faiss.IndexBinaryFlat(bits)  # left empty: the int8 centroids choose the lists
            index = faiss.IndexBinaryIVF(quantizer, bits, spec.nlist)
            index.own_fields = True
            quantizer.this.disown()
            index.is_trained = True
            return index, kmeans_centroids(sample, spec.nlist, seed)
        index = faiss.index_binary_factory(bits, f"BIVF{spec.nlist}")  # which owns its quantiser
        index.train(coder(sample))
        return index, None
    return faiss.IndexBinaryFlat(bits), None


def kmeans_centroids(sample: np.ndarray, count: int, seed: int) -> np.ndarray:
    """`count` centroids (float32 rows, unit length) of the float rows `sample` by faiss's spherical
    k-means, which assigns by inner product as the index scores; seeded with `seed`."""
    kmeans = faiss.Kmeans(sample.shape[1], count, niter=20, spherical=True, seed=seed)
    kmeans.train(np.ascontiguousarray(sample, dtype=np.float32))
    return np.ascontiguousarray(kmeans.centroids, dtype=np.float32)


def centroid_lists(centroids: np.ndarray) -> faiss.IndexScalarQuantizer:
    """A binary IVF's int8 centroids: `centroids` (float32, a row a list) as 8-bit codes of faiss's
    scalar quantiser (over their own ranges), searched by inner product with a float vector for the
    lists it belongs to or probes."""
    lists = faiss.IndexScalarQuantizer(
        centroids.shape[1], faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT
    )
    lists.train(centroids)
    lists.add(centroids)
    return lists


def _add_codes(
    index: faiss.Index | faiss.IndexBinary, vectors: np.ndarray, coder: BinaryCoder | None,
    lists: faiss.IndexScalarQuantizer | None,
) -> None:  # fmt: skip
    """Add the codes of the float rows `vectors` to `index`; with `lists` (a binary IVF's int8
    centroids) each to the list its vector picks."""
    if coder is None:
        index.add(vectors)
        return
    codes = np.ascontiguousarray(coder(vectors))
    if lists is None:
        index.add(codes)
        return
    # faiss's binary IVF picks lists with its binary quantiser in add(); add_core takes lists picked here
    assigned = np.ascontiguousarray(lists.search(vectors, 1)[1][:, 0])
    rows = np.arange(index.ntotal, index.ntotal + len(codes), dtype=np.int64)
    index.add_core(len(codes), faiss.swig_ptr(codes), faiss.swig_ptr(rows), faiss.swig_ptr(assigned))


def _filler(
    index: Any, spec: QuantizedSpec, coder: BinaryCoder | None, lists: faiss.IndexScalarQuantizer | None,
    rows: int, dimension: int, ranges: np.ndarray | None, chunks: recall_module.Chunks,
    check: Callable[[int, np.ndarray], None], advance: Callable[[int], None],
) -> Callable[[Callable[[bytes], None]], None]:  # fmt: skip
    """The pass that adds every row's codes to `index` and gives the copy's bytes (a .npy file: its
    header, then its rows in order) to the function it is called with."""
    quantizer = scalar_quantizer(ranges) if spec.rescore_with == "int8" else None
    dtype = np.uint8 if spec.rescore_with == "int8" else np.float32

    def fill(write: Callable[[bytes], None]) -> None:
        if spec.rescore_with is not None:
            header = io.BytesIO()
            description = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                           "shape": (rows, dimension)}  # fmt: skip
            np.lib.format.write_array_header_1_0(header, description)
            write(header.getvalue())
        for first, vectors in chunks():
            batch = np.ascontiguousarray(vectors, dtype=np.float32)
            check(first, batch)
            _add_codes(index, batch, coder, lists)
            if quantizer is not None:
                write(quantizer.compute_codes(batch).tobytes())
            elif spec.rescore_with is not None:
                write(batch.tobytes())
            advance(len(batch))

    return fill


def _measure(
    index: QuantizedIndex, store: EmbeddingStore, settings: RecallSettings, chunks: recall_module.Chunks,
    show_progress: bool,
) -> tuple[QuantizedSpec, dict[str, Any]]:  # fmt: skip
    """The spec with the setting a target chose (the smallest rescoring depth, after the smallest
    `ef_search` or `nprobe` with the deepest), and the recall@10 and @100 of `index` so searched
    against exact search on held-out queries."""
    held = recall_module.held_out(settings, chunks, len(store))
    if held.vectors.shape[1] != store.dimension:
        raise ValueError(f"{held.source}: {held.vectors.shape[1]}-dimensional query vectors for an index of "
                         f"{store.dimension}")  # fmt: skip
    with progress_bar(
        f"exact search of {len(held.vectors)} held-out queries", len(store), show_progress
    ) as advance:
        recall_module.search_exactly(held, chunks, advance)
    spec, tried = index.spec, {}
    if settings.target is not None:
        spec, tried = _choose(index, held, chunks, settings.target)
    index.spec = spec
    index.set_search_parameters()
    recalls = {f"recall@{depth}": recall_module.search_recall(_rows_of(index), held, chunks, depth)
               for depth in recall_module.RECALL_DEPTHS}  # fmt: skip
    names = ["rescore", spec.search_parameter] if spec.search_parameter else ["rescore"]
    record = recall_module.recall_record(recalls, {name: getattr(spec, name) for name in names}, held)
    if settings.target is not None:
        record |= {"target": settings.target, "tried": tried}
    return spec, record


def _choose(
    index: QuantizedIndex, held: recall_module.HeldOut, chunks: recall_module.Chunks, target: float
) -> tuple[QuantizedSpec, dict[str, dict[int, float]]]:
    """The smallest `ef_search` or `nprobe` meeting `target` when `MAX_RESCORE` x k candidates are
    rescored, then the smallest rescoring depth (0: the codes alone) at it; a `TargetUnreachable` error
    naming the best reached where none meets it."""
    spec, tried = index.spec, {}

    def recall_with(**values: Any) -> Callable[[int], float | None]:
        def recall_of(value: int) -> float | None:
            index.spec = spec.model_copy(update={name: setting(value) for name, setting in values.items()})
            index.set_search_parameters()
            return recall_module.search_recall(_rows_of(index), held, chunks, recall_module.TARGET_DEPTH)

        return recall_of

    parameter = spec.search_parameter
    if parameter is not None:
        if parameter == "nprobe":
            assert spec.nlist is not None, "spec not resolved"
            values = list(range(1, spec.nlist + 1))
        else:  # a list shorter than the results asked for is searched as one of their length
            depth = recall_module.TARGET_DEPTH
            values = list(range(depth, max(depth, min(index.rows, MAX_EF)) + 1))
        found, tried[parameter] = recall_module.smallest_meeting(
            values, recall_with(rescore=lambda _: MAX_RESCORE, **{parameter: lambda value: value}),
            target, lambda value: f"{parameter} {value}, rescoring {MAX_RESCORE} x k",
        )  # fmt: skip
        if found is None:
            best = max(tried[parameter], key=lambda value: tried[parameter][value])
            where = f"--{parameter.replace('_', '-')} {best} and rescoring {MAX_RESCORE} x k"
            chosen = Chosen(spec, tried, tried[parameter][best], where)
            raise recall_module.unreachable(target, chosen, held, _ADVICE)
        spec = spec.model_copy(update={parameter: found})
    depth, tried["rescore"] = recall_module.smallest_meeting(
        list(range(MAX_RESCORE + 1)), recall_with(rescore=lambda value: value or None), target,
        lambda value: f"rescore {value}" if value else "the codes alone",
        largest_meets=parameter is not None,  # the search parameter was chosen rescoring MAX_RESCORE x k
    )  # fmt: skip
    if depth is None:
        best = max(tried["rescore"], key=lambda value: tried["rescore"][value])
        chosen = Chosen(spec, tried, tried["rescore"][best], f"--rescore {best}")
        raise recall_module.unreachable(target, chosen, held, _ADVICE)
    return spec.model_copy(update={"rescore": depth or None}), tried


def _rows_of(index: QuantizedIndex) -> Callable[[np.ndarray, int], np.ndarray]:
    """The rows `index` finds for queries, as it is set now (what recall is counted on)."""
    return lambda queries, depth: index.search(queries, depth).labels


_ADVICE = "choose a lower --target-recall, --rescore-with float32, or --type int8 or flat"


def _memory(spec: QuantizedSpec, rows: int, dimension: int, folder: Path) -> dict[str, Any]:
    """What a vector of the saved index takes: in RAM (its code, and a binary HNSW's graph or IVF's id)
    and on disk (the codes' file and the copy's), against float32's 4 bytes a dimension."""
    on_disk = sum(
        (folder / name).stat().st_size
        for name in (CODES_FILE, RESCORE_FILE, PROJECTION_FILE, CENTROIDS_FILE)
        if (folder / name).exists()
    )
    ram = ram_bytes(spec, rows, dimension)
    return {
        "ram_bytes": ram, "ram_bytes_per_vector": ram / rows,
        "disk_bytes": on_disk, "disk_bytes_per_vector": on_disk / rows,
        "float32_bytes_per_vector": 4 * dimension,
        "rescore_copy": spec.rescore_with,
    }  # fmt: skip
