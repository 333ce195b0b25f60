"""Building, saving, loading and searching Faiss indexes.

An index folder holds `index.faiss`, `ids.txt` (row i's document id), `index.json` (the spec, rows,
dimension and MaxP settings) and densekit's manifest: the identity of the embeddings it was built
from (model weights and settings, corpus digest) and of its ids (their digest, in row order), and a
checksum of each file, checked on load. The ids are checked against the identity too, so that ids
reordered under a recomputed checksum are refused rather than given to other rows.
Folders are written atomically and only ever replace an index folder densekit made.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from densekit.data.hits import Hits
from densekit.data.records import Run
from densekit.diagnostics import DataError, Problem
from densekit.encoding.passages import MaxPSettings, best_passage_run
from densekit.encoding.store import EmbeddingStore
from densekit.index.memory import check_fits
from densekit.index.spec import MAX_TRAINING_POINTS, IndexSpec, SpecError
from densekit.io.artefact import artefact_dir, check_artefact_dir, read_manifest, verify
from densekit.io.fingerprint import write_digested
from densekit.io.outputs import check_not_input
from densekit.progress import progress_bar

log = logging.getLogger("densekit")

INDEX_FILE = "index.faiss"
IDS_FILE = "ids.txt"
META_FILE = "index.json"
KIND = "index"
_ADD_BATCH = 65536
_MAX_TRAINING_POINTS = MAX_TRAINING_POINTS
_WRITE_BLOCK = 4 << 20


def build_index(
    store: EmbeddingStore,
    spec: IndexSpec,
    output: Path,
    seed: int = 0,
    show_progress: bool = True,
    add_batch: int = _ADD_BATCH,
    check_memory: bool = True,
) -> Path:
    """Build an index of `spec` over `store` and save it atomically to `output`: trained on a sample,
    filled `add_batch` vectors at a time, each batch read through a memory map of its own, so only the
    index itself and one batch are held in memory.

    `output` must be new, empty or an index folder densekit made; anything else is refused before
    any work, and so is an output that is, or holds, the embedding folder, and (with `check_memory`) an
    index that needs more memory than is available (`IndexTooLarge`). A vector holding NaN or an
    infinity is an error naming its part's `.npy` file, its row and its document.
    """
    check_not_input(output, [store.folder])
    check_artefact_dir(output, KIND)
    rows, dimension = len(store), store.dimension
    if rows == 0:
        raise DataError([Problem(store.folder, None, "no embeddings to index")])
    spec = spec.resolved(rows, dimension)
    if check_memory:
        check_fits(spec, rows, dimension, add_batch, min(rows, _MAX_TRAINING_POINTS))

    def chunks() -> Iterator[tuple[int, np.ndarray]]:
        offset = 0
        for part in store.parts:
            for start, vectors in part.row_chunks(add_batch):
                yield offset + start, vectors
            offset += int(part.meta["rows"])

    def sample() -> np.ndarray:
        chosen = _training_sample(chunks(), rows, seed)
        if not np.isfinite(chosen).all():
            for part in store.parts:  # find the first bad row of all, not the sample's
                _check_finite(part.vectors(), part.stem.with_suffix(".npy"), part.ids)
        return chosen

    index = _empty_index(spec, dimension, sample)
    flat_rows = _flat_rows(index, rows, dimension) if spec.type == "flat" else None
    if spec.type == "hnsw":
        _reserve_storage(faiss.downcast_index(index.storage), rows)
    with progress_bar(f"indexing ({spec.type})", rows, show_progress) as advance:
        offset = 0
        for part in store.parts:
            part_rows = int(part.meta["rows"])
            into = None if flat_rows is None else flat_rows[offset : offset + part_rows]
            for start, batch in part.row_chunks(add_batch, into):
                _check_finite(batch, part.stem.with_suffix(".npy"), part.ids, start)
                if into is None:
                    index.add(batch)
                advance(len(batch))
            offset += part_rows
    if flat_rows is not None:
        index.ntotal = rows
    meta = {"spec": spec.model_dump(), "rows": rows, "dimension": dimension, "maxp": store.maxp}
    identity = index_identity(store, spec)
    about = {**store.about, "embeddings": str(store.folder)}
    digests: dict[str, str] = {}
    with artefact_dir(output, KIND, identity, about, digests) as tmp:
        digests[INDEX_FILE] = _write_index(index, tmp / INDEX_FILE)
        write_ids(store, tmp / IDS_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return Path(output)


def index_identity(store: EmbeddingStore, spec: IndexSpec) -> dict[str, Any]:
    """What an index of `store` by a resolved `spec` records of what made it: the embeddings, the
    spec and the digest of its ids in row order (`IDS_FILE`'s bytes)."""
    digest = hashlib.sha256()
    for part in store.parts:
        with part.stem.with_suffix(".ids").open("rb") as source:
            while block := source.read(_WRITE_BLOCK):
                digest.update(block)
    return {"embeddings": store.identity, "spec": spec.model_dump(), "ids": f"sha256:{digest.hexdigest()}"}


def write_ids(store: EmbeddingStore, path: Path) -> None:
    """Write `IDS_FILE`: every part's ids, in order (each part's end in a newline)."""
    with path.open("wb") as ids:
        for part in store.parts:
            with part.stem.with_suffix(".ids").open("rb") as source:
                shutil.copyfileobj(source, ids)


def read_ids(folder: Path, identity: dict[str, Any]) -> list[str]:
    """An index folder's ids, refused when they are not those it was built with (an index made before
    its identity held their digest has only its checksum, which `verify` checked)."""
    raw = (folder / IDS_FILE).read_bytes()
    expected = identity.get("ids")
    if expected is not None and f"sha256:{hashlib.sha256(raw).hexdigest()}" != expected:
        reason = ("not the ids the index was built with (their digest differs from its identity's): rows "
                  "would be given other documents' ids; build the index again")  # fmt: skip
        raise DataError([Problem(folder / IDS_FILE, None, reason)])
    try:
        return raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise DataError([Problem(folder / IDS_FILE, None, "not UTF-8 text")]) from None


def _empty_index(spec: IndexSpec, dimension: int, training_sample: Callable[[], np.ndarray]) -> faiss.Index:
    """A trained, empty index of a resolved `spec`."""
    index = faiss.index_factory(dimension, spec.factory_string(), faiss.METRIC_INNER_PRODUCT)
    if spec.type == "hnsw":
        index.hnsw.efConstruction = spec.ef_construction
    if spec.type == "ivfpq":
        # Polysemous training orders the codes for Hamming-distance filtering, which densekit never
        # uses (search results are the same without it), and it takes most of the training time.
        faiss.downcast_index(index).do_polysemous_training = False
    if not index.is_trained:
        index.train(training_sample())
    return index


def _write_index(index: faiss.Index, path: Path) -> str:
    """Save `index` to `path` and return the file's digest, taken as it is written."""
    return write_digested(
        path, lambda write: faiss.write_index(index, faiss.PyCallbackIOWriter(write, _WRITE_BLOCK))
    )


def _flat_rows(index: faiss.IndexFlat, rows: int, dimension: int) -> np.ndarray:
    """A flat index's store, sized for `rows` vectors, as the array to copy them into (the index counts
    them once its `ntotal` is set): faiss's `add` would copy each batch once more and grow the store by
    doubling, copying all it holds each time."""
    size = rows * index.code_size
    index.codes.resize(size)
    return faiss.rev_swig_ptr(index.codes.data(), size).view(np.float32).reshape(rows, dimension)


def _reserve_storage(flat: faiss.IndexFlat, rows: int) -> None:
    """Give HNSW's flat store room for every row before the batches come, so faiss does not grow it by
    doubling, copying all it holds each time."""
    flat.codes.resize(rows * flat.code_size)
    flat.codes.resize(0)  # the room stays


def _training_sample(chunks: Iterable[tuple[int, np.ndarray]], rows: int, seed: int) -> np.ndarray:
    """Up to `_MAX_TRAINING_POINTS` of `rows` rows, drawn uniformly. `chunks` gives the rows in order as
    (first row, array), each let go before the next is read: picking rows out of one map of a whole
    file would leave every page readahead brought in counted as resident (13.5 GB at 8.8M vectors)."""
    take = min(rows, _MAX_TRAINING_POINTS)
    chosen = np.sort(np.random.default_rng(seed).choice(rows, size=take, replace=False))
    sample = []
    for first, vectors in chunks:
        low, high = np.searchsorted(chosen, [first, first + len(vectors)])
        sample.append(np.array(vectors[chosen[low:high] - first], dtype=np.float32))
    return np.ascontiguousarray(np.concatenate(sample))


def _check_finite(vectors: np.ndarray, source: Path, ids: Callable[[], list[str]], start: int = 0) -> None:
    """Raise naming `source`, the row (counted from 0) and the document of the first vector holding NaN
    or an infinity; `vectors` are rows `start`... of `source`."""
    bad = ~np.isfinite(vectors).all(axis=1)
    if bad.any():
        row = start + int(np.argmax(bad))
        values = np.asarray(vectors[row - start])
        what = "NaN" if np.isnan(values).any() else "an infinite value"
        message = f"row {row} (document {ids()[row]!r}) holds {what}; encode the corpus again"
        raise DataError([Problem(source, None, message)])


class SearchIndex:
    """A loaded index: search it with query vectors, get document ids and scores back."""

    def __init__(
        self,
        index: faiss.Index,
        ids: list[str],
        meta: dict[str, Any],
        folder: Path,
        gpu: bool = False,
        identity: dict[str, Any] | None = None,
        mmap: bool = False,
    ):
        self.index = index
        self.mmap = mmap  # its bulk read from its file as searches touch it (`load`)
        self.parameters = faiss.GpuParameterSpace() if gpu else faiss.ParameterSpace()
        self.ids = np.asarray(ids, dtype=object)
        self.meta = meta
        self.folder = folder
        self.identity = identity  # what the saved index was built from; None for one held in memory
        self.spec = IndexSpec(**meta["spec"])
        self.set_search_parameters()

    @classmethod
    def from_vectors(
        cls,
        vectors: np.ndarray,
        ids: list[str],
        spec: IndexSpec = IndexSpec(),
        maxp: MaxPSettings | None = None,
        seed: int = 0,
    ) -> SearchIndex:
        """An index held in memory only (for evaluation and mining inside a run); rows are passages
        of documents when `maxp` says how they were cut. It is the index `build_index` makes of the
        same vectors with the same `seed`."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        _check_finite(vectors, Path("<memory>"), lambda: list(ids))
        spec = spec.resolved(len(vectors), vectors.shape[1])
        index = _empty_index(
            spec, vectors.shape[1], lambda: _training_sample([(0, vectors)], len(vectors), seed)
        )
        index.add(vectors)
        meta = {
            "spec": spec.model_dump(),
            "rows": len(vectors),
            "dimension": vectors.shape[1],
            "maxp": maxp.model_dump() if maxp else None,
        }
        return cls(index, ids, meta, Path("<memory>"))

    @classmethod
    def load(cls, folder: Path | str, gpu: bool = False, mmap: bool = False) -> SearchIndex:
        """Load a saved index after checking its files against their checksums; `gpu` moves it onto
        every GPU faiss sees, and fails if there is none. With `mmap` the bulk of a faiss index (IVF's
        lists, flat and HNSW's vectors) stays in its file, memory-mapped, read as searches touch it."""
        folder = Path(folder)
        if not folder.is_dir():
            raise DataError([Problem(folder, None, "index folder not found")])
        manifest = read_manifest(folder)
        if manifest is None or manifest.kind != KIND:
            what = "no densekit manifest" if manifest is None else f"it holds {manifest.kind}"
            raise DataError([Problem(folder, None, f"not an index folder of densekit's ({what})")])
        verify(folder, manifest)
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
        ids = read_ids(folder, manifest.identity)
        if meta.get("backend") == "milvus":
            from densekit.index.milvus_index import MilvusSearchIndex

            if gpu:
                raise ValueError(f"{folder} is a Milvus index: Milvus searches it, not faiss on a GPU")
            return MilvusSearchIndex(meta, ids, folder, manifest.identity)
        if mmap and gpu:
            raise ValueError("a memory-mapped index is searched on the CPU: ask for a GPU or mmap, not both")
        flags = 0
        if mmap:
            flags = faiss.IO_FLAG_MMAP if meta["spec"]["type"] == "ivfpq" else faiss.IO_FLAG_MMAP_IFC
        try:
            index = faiss.read_index(str(folder / INDEX_FILE), flags)
        except RuntimeError as err:
            problem = Problem(folder / INDEX_FILE, None, f"faiss cannot read it: {_faiss_reason(err)}")
            raise DataError([problem]) from None
        if len(ids) != index.ntotal:
            raise DataError([Problem(folder / IDS_FILE, None, f"{len(ids)} ids for {index.ntotal} vectors")])
        if gpu:
            index = _to_gpus(index, meta["spec"]["type"])
        return cls(index, ids, meta, folder, gpu=gpu, identity=manifest.identity, mmap=mmap)

    @property
    def dimension(self) -> int:
        """The indexed vectors' size."""
        return int(self.index.d)

    @property
    def rows(self) -> int:
        """Vectors held."""
        return int(self.index.ntotal)

    def set_search_parameters(self, ef_search: int | None = None, nprobe: int | None = None) -> None:
        """Set HNSW's candidate list size or IVF's lists probed (None: the spec's value). A value out of
        `IndexSpec`'s bounds, or one the index's type has no use for, raises `SpecError` before faiss
        sees it."""
        for field, value, wanted in (("ef_search", ef_search, "hnsw"), ("nprobe", nprobe, "ivfpq")):
            if value is not None and self.spec.type != wanted:
                reason = f"only {wanted} indexes use it; {self.folder} is {self.spec.type}"
                raise SpecError(field, value, reason)
        spec = self.spec.updated(ef_search=ef_search, nprobe=nprobe)
        if self.spec.type == "hnsw":
            faiss.ParameterSpace().set_index_parameter(self.index, "efSearch", spec.ef_search)
        elif self.spec.type == "ivfpq":
            self.parameters.set_index_parameter(self.index, "nprobe", spec.nprobe)

    def stored_vectors(self, doc_ids: list[str]) -> np.ndarray | None:
        """The vectors indexed for `doc_ids`, exactly as searched, where the index keeps them whole (a
        flat index of whole documents); None where it does not (HNSW and IVF-PQ hold graphs or codes, a
        MaxP index holds passages)."""
        if self.spec.type != "flat" or self.meta.get("maxp") or not hasattr(self.index, "reconstruct_batch"):
            return None
        if not hasattr(self, "_rows"):
            self._rows = {doc_id: row for row, doc_id in enumerate(self.ids)}
        rows = np.array([self._rows[doc_id] for doc_id in doc_ids], dtype=np.int64)
        return self.index.reconstruct_batch(rows)

    def search(self, queries: np.ndarray, k: int) -> Hits:
        """The top `k` rows per query (no more than the index holds); ids are looked up only when asked
        for (`Hits.doc_ids`)."""
        if queries.ndim != 2 or queries.shape[1] != self.dimension:
            raise ValueError(
                f"query vectors of shape {queries.shape}; the index holds dimension {self.dimension}"
            )
        if k < 1:
            raise ValueError(f"k={k}: at least one result per query must be asked for")
        depth = min(k, max(1, int(self.index.ntotal)))
        scores, labels = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), depth)
        return Hits(scores, labels, self.ids)

    def search_run(self, queries: np.ndarray, query_ids: list[str], k: int, skip_self: bool = True) -> Run:
        """The top `k` documents per query as a run. For a MaxP index (rows are passages) a document
        scores its best passage; with `skip_self`, a document whose id is the query's is left out."""
        maxp = self.meta.get("maxp")
        if not maxp:
            return self.search(queries, k + 1 if skip_self else k).to_run(query_ids, k, skip_self)
        depth = (k + 1) * MaxPSettings(**maxp).depth_factor  # `search` caps it at the rows held
        passages = self.search(queries, depth).to_run(query_ids, depth, skip_self=False)
        documents = best_passage_run(passages, k + 1)
        for query_id, ranked in documents.items():
            if skip_self:
                ranked.pop(query_id, None)
            while len(ranked) > k:
                ranked.popitem()
        return documents


def _faiss_reason(err: RuntimeError) -> str:
    """What faiss's exception says is wrong, without its C++ function and source line."""
    text = " ".join(str(err).split())
    short = re.search(r"read error in .*?: (\d+) != (\d+)", text)
    if short:
        return f"it is truncated or damaged (a read got {short.group(1)} of {short.group(2)} items)"
    return re.sub(r"^Error in .*? at \S+: (Error: '.*?' failed: )?", "", text) or "unreadable"


def _to_gpus(index: faiss.Index, index_type: str) -> faiss.Index:
    if not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() == 0:
        raise RuntimeError("--gpu asked for, but this faiss build sees no GPU (install faiss-gpu)")
    if index_type == "hnsw":
        raise RuntimeError("faiss has no GPU HNSW; search an HNSW index on the CPU")
    return faiss.index_cpu_to_all_gpus(index)
