"""The faiss backend: building, saving, loading and searching Faiss indexes.

Its index folder holds `index.faiss` beside what every backend's holds (`densekit.index.base`: the ids,
`index.json`, the manifest). Folders are written atomically and only ever replace an index folder
densekit made.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from densekit.data.hits import Hits
from densekit.diagnostics import DataError, Problem
from densekit.encoding.passages import MaxPSettings
from densekit.encoding.store import EmbeddingStore
from densekit.errors import InputError, StateError
from densekit.index import recall as recall_module
from densekit.index.base import (
    ADD_BATCH,
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
from densekit.index.exact_search import exact_top_k
from densekit.index.memory import IndexTooLarge, amount, available_memory, check_fits, vectors_bytes
from densekit.index.recall import RecallSettings, gather_rows
from densekit.index.spec import MAX_TRAINING_POINTS, IndexSpec, SpecError, training_rows
from densekit.io.fingerprint import write_digested
from densekit.progress import progress_bar

log = logging.getLogger("densekit")

INDEX_FILE = "index.faiss"
_ADD_BATCH = ADD_BATCH
_MAX_TRAINING_POINTS = MAX_TRAINING_POINTS
_WRITE_BLOCK = 4 << 20


def _training_rows(spec: IndexSpec, rows: int) -> int:
    """The vectors a resolved `spec` trains on (none for a type that is not trained)."""
    if spec.type != "ivfpq":
        return 0
    assert spec.nlist is not None, "spec not resolved"
    return training_rows(rows, spec.nlist, _MAX_TRAINING_POINTS)


def _measure(
    index: faiss.Index,
    spec: IndexSpec,
    store: EmbeddingStore,
    settings: RecallSettings | None,
    chunks: recall_module.Chunks,
    check_memory: bool,
    show_progress: bool,
) -> tuple[faiss.Index, IndexSpec, dict[str, Any] | None]:
    """The index (wrapped in re-ranking where a target needs it), its spec with the search setting a
    target chose, and its recall against exact search on held-out queries (None: not measured)."""
    if settings is None:
        return index, spec, None
    if spec.type == "flat":
        target = {"target": settings.target} if settings.target is not None else {}
        return index, spec, recall_module.exact_record() | target
    held = recall_module.held_out(settings, chunks, len(store))
    if held.vectors.shape[1] != store.dimension:
        raise InputError(f"{held.source}: {held.vectors.shape[1]}-dimensional query vectors for an index of "
                         f"{store.dimension}")  # fmt: skip
    searching = f"exact search of {len(held.vectors)} held-out queries"
    with progress_bar(searching, len(store), show_progress) as advance:
        recall_module.search_exactly(held, chunks, advance)
    chosen = None
    if settings.target is not None:
        chosen = recall_module.choose_parameter(index, spec, held, chunks, settings.target)
        if chosen.best is not None and spec.type == "ivfpq":
            index = _with_refine(index, store, chunks, check_memory)
            chosen = recall_module.choose_refined(index, spec, held, chunks, settings.target)
        if chosen.best is not None:
            advice = {"ivfpq": "choose a larger --pq-m, a lower --target-recall, or --type flat",
                      "hnsw": "build with a larger --hnsw-m or --ef-construction, choose a lower "
                              "--target-recall, or --type flat"}[spec.type]  # fmt: skip
            raise recall_module.unreachable(settings.target, chosen, held, advice)
        spec = chosen.spec
    record = recall_module.measured(index, spec, held, chunks)
    if chosen is not None:
        record |= {"target": settings.target, "tried": chosen.tried}
    if spec.refine_k_factor is not None:
        record["refine_bytes"] = vectors_bytes(len(store), store.dimension)
    return index, spec, record


def _with_refine(
    index: faiss.Index, store: EmbeddingStore, chunks: recall_module.Chunks, check_memory: bool
) -> faiss.Index:
    """`index` wrapped in faiss's re-ranking with the exact vectors (`IndexRefine` over a flat index,
    read back as `IndexRefineFlat`), which holds every vector whole: refused first, naming that cost,
    when it will not fit."""
    needed = vectors_bytes(len(store), store.dimension)
    available, source = available_memory()
    if check_memory and needed > available:
        raise IndexTooLarge(
            f"IVF-PQ's codes alone cannot meet --target-recall, and re-ranking with the exact vectors would "
            f"hold every vector whole, {amount(needed)} more; {amount(available)} are available ({source}): "
            "choose a lower --target-recall, a larger --pq-m, free memory, or pass --no-memory-check"
        )
    exact = faiss.IndexFlatIP(store.dimension)
    for _, batch in chunks():
        exact.add(np.ascontiguousarray(batch, dtype=np.float32))
    return faiss.IndexRefine(index, exact)  # which holds both


def _empty_index(spec: IndexSpec, dimension: int, training_sample: Callable[[], np.ndarray]) -> faiss.Index:
    """A trained, empty index of a resolved `spec`."""
    index = faiss.index_factory(dimension, spec.factory_string(), faiss.METRIC_INNER_PRODUCT)
    if spec.type == "hnsw":
        index.hnsw.efConstruction = spec.ef_construction
    if spec.type == "ivfpq":
        # Polysemous training orders the codes for Hamming-distance filtering, which densekit never
        # uses (search results are the same without it), and it takes most of the training time. The
        # IVF-PQ index may be under faiss's re-ranking (`refine_k_factor`).
        faiss.downcast_index(faiss.extract_index_ivf(index)).do_polysemous_training = False
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


def _stored_rows(index: faiss.IndexFlat) -> np.ndarray:
    """A flat index's vectors (rows, dimension), read in place from faiss's store."""
    rows, dimension = int(index.ntotal), int(index.d)
    return faiss.rev_swig_ptr(index.get_xb(), rows * dimension).reshape(rows, dimension)


def _reserve_storage(flat: faiss.IndexFlat, rows: int) -> None:
    """Give HNSW's flat store room for every row before the batches come, so faiss does not grow it by
    doubling, copying all it holds each time."""
    flat.codes.resize(rows * flat.code_size)
    flat.codes.resize(0)  # the room stays


def _training_sample(
    chunks: Iterable[tuple[int, np.ndarray]], rows: int, seed: int, take: int
) -> np.ndarray:
    """`take` of `rows` rows, drawn uniformly, gathered a chunk at a time (`gather_rows`)."""
    chosen = np.sort(np.random.default_rng(seed).choice(rows, size=take, replace=False))
    return gather_rows(chunks, chosen)


class FaissIndex(SearchIndex, backend="faiss"):
    """A Faiss index: flat (exact), HNSW or IVF-PQ, by inner product; saved in `index.faiss`."""

    types = ("flat", "hnsw", "ivfpq")
    exact_types = ("flat",)
    spec_class = IndexSpec

    @classmethod
    def build(cls, store: EmbeddingStore, spec: IndexSpec, output: Path, options: BuildOptions) -> Path:
        """Build an index of `spec` over `store` and save it atomically to `output`: trained on a sample
        (`options.seed`), filled `options.add_batch` vectors at a time, each batch read through a memory
        map of its own, so only the index itself and one batch are held in memory.

        Given `options.recall` (`densekit index` gives one: 1,000 of the collection's own vectors unless
        told), an approximate index's recall@10 and @100 against exact search are then measured on
        held-out queries and recorded in the manifest's `about`; with a target, the smallest search
        setting meeting it is saved in the spec (`densekit.index.recall`), and a target no setting meets
        is a `TargetUnreachable` error. Without one (None) nothing is measured.

        `output` must be new, empty or an index folder densekit made from the same embeddings and spec
        (from others only with `options.overwrite`, checked again as the folder takes its place);
        anything else is refused before any work, and so is an output that is, or holds, the embedding
        folder, and (with
        `options.check_memory`) an index that needs more memory than is available (`IndexTooLarge`). A
        vector holding NaN or an infinity is an error naming its part's `.npy` file, its row and its
        document.
        """
        rows, dimension = len(store), store.dimension
        if rows == 0:
            raise DataError([Problem(store.folder, None, "no embeddings to index")])
        spec = spec.resolved(rows, dimension)
        recall = options.recall
        identity = index_identity(store, spec)  # as asked: a target's choice is in `index.json`
        if recall is not None and recall.identity() is not None:
            identity["recall_target"] = recall.identity()
        check_output(output, store, identity, options.overwrite)
        add_batch = options.add_batch
        if options.check_memory:
            check_fits(spec, rows, dimension, add_batch, _training_rows(spec, rows))
        chunks = recall_module.chunk_reader(store.parts, add_batch)

        def sample() -> np.ndarray:
            chosen = _training_sample(chunks(), rows, options.seed, _training_rows(spec, rows))
            if not np.isfinite(chosen).all():
                for part in store.parts:  # find the first bad row of all, not the sample's
                    check_finite_rows(part.vectors(), part.stem.with_suffix(".npy"), part.ids)
            return chosen

        index = _empty_index(spec, dimension, sample)
        flat_rows = _flat_rows(index, rows, dimension) if spec.type == "flat" else None
        if spec.type == "hnsw":
            _reserve_storage(faiss.downcast_index(index.storage), rows)
        with progress_bar(f"indexing ({spec.type})", rows, options.show_progress) as advance:
            offset = 0
            for part in store.parts:
                part_rows = int(part.meta["rows"])
                into = None if flat_rows is None else flat_rows[offset : offset + part_rows]
                for start, batch in part.row_chunks(add_batch, into):
                    check_finite_rows(batch, part.stem.with_suffix(".npy"), part.ids, start)
                    if into is None:
                        index.add(batch)
                    advance(len(batch))
                offset += part_rows
        if flat_rows is not None:
            index.ntotal = rows
        built, chosen, measured = _measure(
            index, spec, store, recall, chunks, options.check_memory, options.show_progress
        )
        meta = {"spec": chosen.model_dump(), "rows": rows, "dimension": dimension, "maxp": store.maxp}
        about = {**store.about, "embeddings": str(store.folder)}
        if measured is not None:
            about["recall"] = measured
        digests: dict[str, str] = {}
        with index_folder(output, identity, about, options.overwrite, digests) as tmp:
            digests[INDEX_FILE] = _write_index(built, tmp / INDEX_FILE)
            write_ids(store, tmp / IDS_FILE)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        return output

    @classmethod
    def summary(cls, meta: dict[str, Any], about: dict[str, Any]) -> str:
        """The recall measured against exact search and the search setting saved ("flat: exact search"
        for a flat index; nothing where nothing was measured)."""
        return recall_module.recall_words(about.get("recall"))

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
    ) -> FaissIndex:
        """An index held in memory only (for evaluation and mining inside a run); rows are passages
        of documents when `maxp` says how they were cut. It is the index `build_index` makes of the
        same vectors with the same `seed`."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        check_finite_rows(vectors, Path("<memory>"), lambda: list(ids))
        spec = spec.resolved(len(vectors), vectors.shape[1])
        take = _training_rows(spec, len(vectors))
        index = _empty_index(
            spec, vectors.shape[1], lambda: _training_sample([(0, vectors)], len(vectors), seed, take)
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
    def open(
        cls, folder: Path, meta: dict[str, Any], ids: list[str], identity: dict[str, Any], gpu: bool,
        mmap: bool,
    ) -> FaissIndex:
        """The saved `index.faiss` of `folder`; `gpu` moves it onto every GPU faiss sees, and fails if
        there is none. With `mmap` the bulk of the index (IVF's lists, flat and HNSW's vectors) stays in
        its file, memory-mapped, read as searches touch it."""
        if mmap and gpu:
            raise InputError("a memory-mapped index is searched on the CPU: ask for a GPU or mmap, not both")
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
        return cls(index, ids, meta, folder, gpu=gpu, identity=identity, mmap=mmap)

    @property
    def dimension(self) -> int:
        """The indexed vectors' size."""
        return int(self.index.d)

    @property
    def rows(self) -> int:
        """Vectors held."""
        return int(self.index.ntotal)

    @property
    def mapped_file(self) -> Path | None:
        """`index.faiss`, when the index was loaded memory-mapped."""
        return self.folder / INDEX_FILE if self.mmap else None

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
            if spec.refine_k_factor is not None:
                self.parameters.set_index_parameter(self.index, "k_factor_rf", spec.refine_k_factor)

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
        for (`Hits.doc_ids`). HNSW searches with a candidate list of at least `k` (`ef_search` is the
        list for fewer results): faiss would return fewer than `k` from a shorter one."""
        if queries.ndim != 2 or queries.shape[1] != self.dimension:
            raise InputError(
                f"query vectors of shape {queries.shape}; the index holds dimension {self.dimension}"
            )
        if k < 1:
            raise InputError(f"k={k}: at least one result per query must be asked for")
        depth = min(k, max(1, int(self.index.ntotal)))
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if type(self.index) is faiss.IndexFlatIP and self.index.ntotal:  # exact, on the CPU
            scores, labels = exact_top_k(_stored_rows(self.index), queries, depth)
        else:
            scores, labels = recall_module.search_deep_enough(self.index, queries, depth)
        return Hits(scores, labels, self.ids)


def _faiss_reason(err: RuntimeError) -> str:
    """What faiss's exception says is wrong, without its C++ function and source line."""
    text = " ".join(str(err).split())
    short = re.search(r"read error in .*?: (\d+) != (\d+)", text)
    if short:
        return f"it is truncated or damaged (a read got {short.group(1)} of {short.group(2)} items)"
    return re.sub(r"^Error in .*? at \S+: (Error: '.*?' failed: )?", "", text) or "unreadable"


def _to_gpus(index: faiss.Index, index_type: str) -> faiss.Index:
    if not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() == 0:
        raise StateError("--gpu asked for, but this faiss build sees no GPU (install faiss-gpu)")
    if index_type == "hnsw":
        raise StateError("faiss has no GPU HNSW; search an HNSW index on the CPU")
    return faiss.index_cpu_to_all_gpus(index)
