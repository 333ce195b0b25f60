"""What an index backend provides, the folder every backend saves, and the one loader that opens a saved
folder with the backend that made it.

An index folder holds `ids.txt` (row i's document id), `index.json` (the spec, rows, dimension, MaxP
settings and, for any backend but faiss, the backend's name and settings), the backend's own files and
densekit's manifest: the identity of the embeddings it was built from (model weights and settings,
corpus digest) and of its ids (their digest, in row order), and a checksum of each file, checked on
load. The ids are checked against the identity too, so that ids reordered under a recomputed checksum
are refused rather than given to other rows.

Backends are the modules of `densekit.index.backends`, one file each, found when a backend is first
asked for (`registered_backends`), so that importing `densekit.index` imports no search engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import pkgutil
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ValidationError

from densekit.data.hits import Hits
from densekit.data.records import Run
from densekit.diagnostics import DataError, Problem
from densekit.encoding.passages import MaxPSettings, best_passage_run
from densekit.encoding.store import EmbeddingStore
from densekit.index.spec import SpecError
from densekit.io.artefact import MANIFEST, artefact_dir, check_artefact_dir, open_artefact, verify
from densekit.io.outputs import check_artefact_output

if TYPE_CHECKING:
    from densekit.index.recall import RecallSettings

IDS_FILE = "ids.txt"
META_FILE = "index.json"
KIND = "index"
DEFAULT_BACKEND = "faiss"  # the backend of a folder whose index.json names none
_READ_BLOCK = 4 << 20
ADD_BATCH = 65536  # vectors read and added at once while building
BACKENDS_PACKAGE = "densekit.index.backends"


@dataclass(frozen=True)
class BuildOptions:
    """How any backend builds an index, whatever its spec: the seed of any sample it draws, the progress
    bar, the memory check before the work, recall measured against exact search (None: not measured),
    whether another index at the output may be replaced, and the vectors read at once."""

    seed: int = 0
    show_progress: bool = True
    check_memory: bool = True
    recall: RecallSettings | None = None
    overwrite: bool = False
    add_batch: int = ADD_BATCH


def index_identity(store: EmbeddingStore, spec: BaseModel) -> dict[str, Any]:
    """What an index of `store` by a backend's resolved `spec` records of what made it: the embeddings,
    the spec and the digest of its ids in row order (`IDS_FILE`'s bytes)."""
    digest = hashlib.sha256()
    for part in store.parts:
        with part.stem.with_suffix(".ids").open("rb") as source:
            while block := source.read(_READ_BLOCK):
                digest.update(block)
    return {"embeddings": store.identity, "spec": spec.model_dump(), "ids": f"sha256:{digest.hexdigest()}"}


def write_ids(store: EmbeddingStore, path: Path) -> None:
    """Write `IDS_FILE`: every part's ids, in order (each part's end in a newline)."""
    with path.open("wb") as ids:
        for part in store.parts:
            with part.stem.with_suffix(".ids").open("rb") as source:
                shutil.copyfileobj(source, ids)


def read_ids(folder: Path, identity: dict[str, Any]) -> list[str]:
    """An index folder's ids, refused when they are not those it was built with, or when its identity
    holds no digest of them to tell (their checksum alone would pass ids reordered under a recomputed
    manifest)."""
    raw = (folder / IDS_FILE).read_bytes()
    expected = identity.get("ids")
    if not isinstance(expected, str):
        reason = (
            "its identity holds no digest of its ids (an index of an older densekit, or an edited manifest), "
            "so its rows cannot be matched to their documents: build the index again"
        )
        raise DataError([Problem(folder / MANIFEST, None, reason)])
    if f"sha256:{hashlib.sha256(raw).hexdigest()}" != expected:
        reason = ("not the ids the index was built with (their digest differs from its identity's): rows "
                  "would be given other documents' ids; build the index again")  # fmt: skip
        raise DataError([Problem(folder / IDS_FILE, None, reason)])
    try:
        return raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise DataError([Problem(folder / IDS_FILE, None, "not UTF-8 text")]) from None


def check_finite_rows(
    vectors: np.ndarray, source: Path, ids: Callable[[], list[str]], start: int = 0
) -> None:
    """Raise naming `source`, the row (counted from 0) and the document of the first vector holding NaN
    or an infinity; `vectors` are rows `start`... of `source`."""
    bad = ~np.isfinite(vectors).all(axis=1)
    if bad.any():
        row = start + int(np.argmax(bad))
        values = np.asarray(vectors[row - start])
        what = "NaN" if np.isnan(values).any() else "an infinite value"
        message = f"row {row} (document {ids()[row]!r}) holds {what}; encode the corpus again"
        raise DataError([Problem(source, None, message)])


def check_output(output: Path, store: EmbeddingStore, identity: dict[str, Any], overwrite: bool) -> None:
    """Refuse, before any work, an index `output` that is, or holds, the embedding folder, or that is
    something other than new, empty, or an index folder densekit made from this `identity` (from
    another one only with `overwrite`), naming what differs."""
    check_artefact_dir(output, KIND)  # a file, or a folder densekit did not make, named as such
    check_artefact_output(output, KIND, identity, [store.folder], overwrite)


@contextlib.contextmanager
def index_folder(
    output: Path,
    identity: dict[str, Any],
    about: dict[str, Any],
    overwrite: bool,
    digests: dict[str, str] | None = None,
) -> Iterator[Path]:
    """A temporary folder to write an index into, which takes `output`'s place in one step, with its
    manifest (`identity`, `about` and each file's checksum; `digests` holds those computed as the files
    were written), when the block ends. What is at `output` then is checked again as `check_output` did
    before the work: an index another build finished meanwhile, of another identity, is not replaced
    without `overwrite`."""

    def replaceable(existing: Path) -> bool:
        check_artefact_output(existing, KIND, identity, overwrite=overwrite)
        return True

    with artefact_dir(output, KIND, identity, about, digests, may_replace=replaceable) as tmp:
        yield tmp


def registered_backends() -> dict[str, type[SearchIndex]]:
    """Every backend, by name, in name order: the modules of `densekit.index.backends`, imported on
    first use (each registers itself by subclassing `SearchIndex`), so that importing `densekit.index`
    imports no search engine, and a new backend is one new file there."""
    package = importlib.import_module(BACKENDS_PACKAGE)
    for found in sorted(pkgutil.iter_modules(package.__path__), key=lambda found: found.name):
        importlib.import_module(f"{BACKENDS_PACKAGE}.{found.name}")  # once: then a look-up
    return dict(sorted(SearchIndex.backends.items()))  # whichever was imported first


class SearchIndex(ABC):
    """A backend's index: built from saved embeddings, saved, loaded, searched with query vectors for
    document ids and scores.

    A backend is a subclass declared with its name, `class FaissIndex(SearchIndex, backend="faiss")`,
    in one module of `densekit.index.backends`, which registers it: `densekit index --backend NAME`
    (or a `--type` it builds), the recipes' index step and `build_index` build with it, and
    `SearchIndex.load` opens every saved folder whose `index.json` names it. It declares:

    - `types`: the `--type` values it builds, its default first, and `exact_types`, those that search
      exactly (recall options are refused for them: there is nothing to measure);
    - `spec_class`: its settings, a pydantic model whose `type` is one of `types` and whose fields are
      its options (`--hnsw-m` for `hnsw_m`); the docstring's first line describes it in `index --help`;
    - `build(store, spec, output, options)`: its index of an embedding folder, saved atomically
      (`check_output` with its identity before the work, `index_folder` to write), and `summary`, what
      `densekit index` prints of the folder it built.

    A loaded index sets `ids` (row i's document id, as an object array), `meta` (the folder's
    `index.json`), `folder`, `identity` (the manifest's; None for an index held in memory) and `spec`,
    and provides:

    - `open(folder, meta, ids, identity, gpu, mmap)`: its index of a saved folder, whose manifest,
      checksums and ids the loader has checked;
    - `dimension` and `rows`: the size of the vectors and how many are held;
    - `search(queries, k)`: the top `k` rows per query as `Hits`;
    - `set_search_parameters(ef_search, nprobe)`: a `SpecError` for a parameter it has no use for;
    - `stored_vectors(doc_ids)`: the vectors it holds for documents, or None where it keeps none whole.

    `search_run` (documents by id, MaxP's best passage) and `mapped_file` are shared.
    """

    backend: ClassVar[str]
    types: ClassVar[tuple[str, ...]]
    exact_types: ClassVar[tuple[str, ...]] = ()
    spec_class: ClassVar[type[BaseModel]]
    backends: ClassVar[dict[str, type[SearchIndex]]] = {}

    ids: np.ndarray
    meta: dict[str, Any]
    folder: Path
    identity: dict[str, Any] | None
    spec: Any

    def __init_subclass__(cls, backend: str | None = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if backend is None:
            return
        if backend in SearchIndex.backends:
            raise TypeError(f"index backend {backend!r} is registered twice")
        if not getattr(cls, "types", None) or not isinstance(getattr(cls, "spec_class", None), type):
            raise TypeError(f"index backend {backend!r} declares no `types` or no `spec_class`")
        if any(other.spec_class is cls.spec_class for other in SearchIndex.backends.values()):
            raise TypeError(f"index backend {backend!r} shares its spec class with another backend")
        cls.backend = backend
        SearchIndex.backends[backend] = cls

    @classmethod
    def load(cls, folder: Path | str, gpu: bool = False, mmap: bool = False) -> SearchIndex:
        """Load a saved index, with the backend its `index.json` names, after checking its files
        against their checksums and its ids against its identity; `gpu` and `mmap` ask the backend to
        search on every GPU it sees, or with the bulk of the index memory-mapped from its file."""
        folder = Path(folder)
        manifest = open_artefact(folder, KIND, "index folder")
        verify(folder, manifest)
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
        ids = read_ids(folder, manifest.identity)
        name = meta.get("backend", DEFAULT_BACKEND)
        backends = registered_backends()
        backend = backends.get(name)
        if backend is None:
            known = ", ".join(sorted(backends))
            raise DataError([Problem(folder / META_FILE, None, f"backend {name!r}: densekit knows {known}")])
        return backend.open(folder, meta, ids, manifest.identity, gpu=gpu, mmap=mmap)

    @classmethod
    def spec_of(cls, values: dict[str, Any]) -> BaseModel:
        """This backend's spec from `values` (its `type` among them); `SpecError` names the first value
        out of its bounds, or one that is none of its settings."""
        try:
            return cls.spec_class.model_validate(values)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            reason = first["msg"]
            if first["type"] == "extra_forbidden":
                settings = ", ".join(name for name in cls.spec_class.model_fields if name != "type")
                reason = f"not a setting of the {cls.backend} backend (its settings: {settings or 'none'})"
            elif first["type"] == "missing":
                reason = f"the {cls.backend} backend needs it"
            raise SpecError(field, values.get(field), reason) from None

    @classmethod
    @abstractmethod
    def build(cls, store: EmbeddingStore, spec: Any, output: Path, options: BuildOptions) -> Path:
        """Build this backend's index of `spec` (an instance of `spec_class`) over `store` and save it
        atomically to `output`, which `check_output` must allow before any work."""

    @classmethod
    def summary(cls, meta: dict[str, Any], about: dict[str, Any]) -> str:
        """What `densekit index` prints after the name of a folder it built, from its `index.json`
        (`meta`) and its manifest's `about`: nothing more by default."""
        return ""

    @classmethod
    @abstractmethod
    def open(
        cls, folder: Path, meta: dict[str, Any], ids: list[str], identity: dict[str, Any], gpu: bool,
        mmap: bool,
    ) -> SearchIndex:
        """This backend's index of the saved `folder` (its `index.json` as `meta`, its checked `ids`
        and its manifest's `identity`)."""

    @property
    @abstractmethod
    def dimension(self) -> int:
        """The indexed vectors' size."""

    @property
    @abstractmethod
    def rows(self) -> int:
        """Vectors held."""

    @abstractmethod
    def set_search_parameters(self, ef_search: int | None = None, nprobe: int | None = None) -> None:
        """Set the search's parameters (None: the spec's value); one the backend has no use for, or out
        of its spec's bounds, raises `SpecError` before the backend sees it."""

    @abstractmethod
    def stored_vectors(self, doc_ids: list[str]) -> np.ndarray | None:
        """The vectors indexed for `doc_ids`, exactly as searched, or None where the index does not
        keep them whole."""

    @abstractmethod
    def search(self, queries: np.ndarray, k: int) -> Hits:
        """The top `k` rows per query (no more than the index holds); ids are looked up only when
        asked for (`Hits.doc_ids`)."""

    @property
    def mapped_file(self) -> Path | None:
        """The file a memory-mapped index reads as it is searched; None when nothing is mapped."""
        return None

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
