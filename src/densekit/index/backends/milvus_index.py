"""An index held by Milvus (a cluster, or Milvus Lite's local file) instead of a local Faiss file.

`build_milvus_index` writes the embeddings into a Milvus collection (primary key `id`: the row number;
exact inner-product search, FLAT) and a small local index folder that names it: `index.json` records
the backend, URI, collection, rows and dimension beside `ids.txt`, under densekit's manifest with the
identity of the embeddings. Every command that takes an index folder (`search`, `serve`, `mine`)
therefore works unchanged; pointing at a cluster instead of Milvus Lite changes only the URI.

The collection carries the digest of that identity as a property, set only once every row is in: a
collection densekit did not make is never written, one of other embeddings is replaced only with
`overwrite`, and a folder whose collection was since rewritten is refused at load.

A Milvus Lite URI (a local path ending in `.db`) is recorded absolute, and must be new, an empty
folder or a Milvus Lite database: a folder or file of the user's is never written into. Collection
names follow Milvus's rule, checked before Milvus is asked; Milvus's errors come as one line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from densekit.data.hits import Hits
from densekit.diagnostics import DataError, Problem
from densekit.encoding.store import EmbeddingStore
from densekit.errors import InputError, StateError
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
from densekit.index.spec import IndexSpec, SpecError
from densekit.io.fingerprint import digest_of
from densekit.io.outputs import OutputError
from densekit.progress import progress_bar

log = logging.getLogger("densekit")

BACKEND = "milvus"
IDENTITY_PROPERTY = "densekit.identity"
_INCOMPLETE = "incomplete:"
_INSERT_BATCH = 2048
_MAX_TOP_K = 16384  # Milvus's limit on hits per query
# Milvus's rule for collection names (its docs' limits): a letter or '_' first, then letters, digits
# and '_', 255 characters at most. Milvus Lite accepts more, a Milvus server does not.
_COLLECTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")
_SERVER_SCHEMES = ("unix", "http", "https", "tcp", "grpc")  # any other URI is Milvus Lite's (pymilvus)


class _QuietGrpcServer(logging.Filter):
    """Milvus Lite's gRPC server logs a traceback for every call it does not implement, which pymilvus
    makes and recovers from (`AllocTimestamp`), and for every error it answers with, which the client
    raises and densekit reports in one line. The first are dropped; the second are kept for --verbose
    (debug), so nothing the user needs is lost."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Exception calling application"):
            return True
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, NotImplementedError):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_GRPC_FILTER = _QuietGrpcServer()


@contextlib.contextmanager
def _milvus_errors(uri: str) -> Iterator[None]:
    """Milvus's exceptions as one line naming the URI."""
    from pymilvus.exceptions import MilvusException

    try:
        yield
    except MilvusException as err:
        message = " ".join(str(getattr(err, "message", "") or err).split())
        raise StateError(f"Milvus at {uri}: {message}") from None


def _client(uri: str) -> Any:
    try:
        from pymilvus import MilvusClient
    except ImportError:
        raise StateError("the Milvus backend needs pymilvus: pip install 'densekit[milvus]'") from None

    grpc_server = logging.getLogger("grpc._server")
    if _GRPC_FILTER not in grpc_server.filters:
        grpc_server.addFilter(_GRPC_FILTER)
    with _milvus_errors(uri):
        return MilvusClient(uri)


def check_collection_name(name: str) -> None:
    """Refuse a collection name Milvus would (naming the rule), before Milvus is asked."""
    if not _COLLECTION_NAME.fullmatch(name):
        shown = name if len(name) <= 60 else f"{name[:40]}... ({len(name)} characters)"
        raise SpecError("collection", shown, "Milvus takes a letter or '_' first, then letters, digits and "
                                             "'_', 255 characters at most")  # fmt: skip


def default_collection(output: Path) -> str:
    """The collection an index folder names by default: its folder's name, made a valid one."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", Path(output).resolve().name) or "index"
    return (name if not name[0].isdigit() else "_" + name)[:255]


def milvus_uri(uri: str) -> str:
    """`uri` as the index records it: a server's as given, Milvus Lite's (a local path) absolute, after
    checking the path is new, an empty folder or a Milvus Lite database (never a file or a folder of
    the user's, which Milvus Lite would write into)."""
    if urlparse(uri).scheme.lower() in _SERVER_SCHEMES:
        return uri
    if not uri.endswith(".db"):
        raise SpecError("uri", uri, "a Milvus server's URI (http://, https://, tcp://, unix:) or a Milvus "
                                    "Lite database path ending in .db")  # fmt: skip
    path = Path(uri).expanduser().resolve()
    if path.is_file() or (path.exists() and not path.is_dir()):
        raise SpecError("uri", uri, f"{path} is a file; Milvus Lite keeps its database in a folder of that "
                                    "name, so densekit leaves it alone: give a new path")  # fmt: skip
    if path.is_dir() and any(path.iterdir()) and not _is_milvus_lite_database(path):
        raise SpecError("uri", uri, f"{path} is a folder that is not a Milvus Lite database; densekit does "
                                    "not write into it: give a new path ending in .db")  # fmt: skip
    if not path.parent.is_dir():
        raise SpecError("uri", uri, f"no folder {path.parent} to hold the database")
    return str(path)


def _is_milvus_lite_database(folder: Path) -> bool:
    """Whether `folder` holds what Milvus Lite keeps in a database folder (its lock, collections and
    databases)."""
    from milvus_lite.db import COLLECTIONS_DIRNAME, DATABASES_DIRNAME, LOCK_FILENAME

    return (folder / LOCK_FILENAME).is_file() and all(
        (folder / name).is_dir() for name in (COLLECTIONS_DIRNAME, DATABASES_DIRNAME)
    )


def build_milvus_index(
    store: EmbeddingStore,
    output: Path,
    uri: str,
    collection: str,
    overwrite: bool = False,
    show_progress: bool = True,
) -> Path:
    """Write `store` into `collection` at `uri` and the index folder `output` that names it; a Milvus
    Lite path is recorded absolute. A folder naming another collection, or of other embeddings, is
    replaced only with `overwrite`, as is a collection of other embeddings."""
    check_collection_name(collection)
    uri = milvus_uri(uri)
    rows, dimension = len(store), store.dimension
    if rows == 0:
        raise DataError([Problem(store.folder, None, "no embeddings to index")])
    spec = IndexSpec(type="flat")
    where = {"uri": uri, "collection": collection}
    identity = {**index_identity(store, spec), "backend": BACKEND, "milvus": where}
    check_output(output, store, identity, overwrite)
    digest = digest_of(identity)
    client = _client(uri)
    with _milvus_errors(uri):
        _fill_collection(client, store, uri, collection, digest, overwrite, show_progress)
    meta = {"spec": spec.model_dump(), "rows": rows, "dimension": dimension, "maxp": store.maxp,
            "backend": BACKEND, "uri": uri, "collection": collection}  # fmt: skip
    about = {**store.about, "embeddings": str(store.folder)}
    with index_folder(output, identity, about, overwrite) as tmp:
        write_ids(store, tmp / IDS_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return Path(output)


def _fill_collection(
    client: Any, store: EmbeddingStore, uri: str, collection: str, digest: str, overwrite: bool,
    show_progress: bool,
) -> None:  # fmt: skip
    """Write every vector of `store` into `collection`, unless it holds them already (`digest`)."""
    from pymilvus import DataType, MilvusClient  # importable: `_client` has checked

    rows, dimension = len(store), store.dimension
    if _claim_collection(client, uri, collection, digest, overwrite) == "new":
        schema = MilvusClient.create_schema(auto_id=False)
        schema.add_field("id", DataType.INT64, is_primary=True)  # the row number
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=dimension)
        index_params = client.prepare_index_params()
        index_params.add_index(field_name="vector", index_type="FLAT", metric_type="IP")
        client.create_collection(
            collection,
            schema=schema,
            index_params=index_params,
            properties={IDENTITY_PROPERTY: _INCOMPLETE + digest},
        )
        start = 0
        with progress_bar(f"writing to Milvus ({collection})", rows, show_progress) as advance:
            for part in store.parts:
                vectors = part.vectors()
                for offset in range(0, len(vectors), _INSERT_BATCH):
                    batch = np.ascontiguousarray(vectors[offset : offset + _INSERT_BATCH], dtype=np.float32)
                    check_finite_rows(batch, part.stem.with_suffix(".npy"), part.ids, offset)
                    client.insert(
                        collection,
                        [{"id": start + i, "vector": v} for i, v in enumerate(batch.tolist())],
                    )
                    start += len(batch)
                    advance(len(batch))
        client.flush(collection)
        client.alter_collection_properties(collection, properties={IDENTITY_PROPERTY: digest})


def _claim_collection(client: Any, uri: str, collection: str, digest: str, overwrite: bool) -> str:
    """ "new" when the collection must be (re)written, "matching" when it already holds these rows."""
    if not client.has_collection(collection):
        return "new"
    saved = client.describe_collection(collection).get("properties", {}).get(IDENTITY_PROPERTY)
    if saved is None:
        raise OutputError(
            f"Milvus collection {collection!r} at {uri} was not made by densekit; it is left as it is: "
            "choose another --collection"
        )
    if saved == digest:
        log.info("Milvus collection %r already holds these embeddings", collection)
        return "matching"
    if saved.startswith(_INCOMPLETE) or overwrite:  # ours: a killed build, or replaced on request
        client.drop_collection(collection)
        return "new"
    raise OutputError(
        f"Milvus collection {collection!r} at {uri} holds other embeddings; pass --overwrite to replace "
        "it, or choose another --collection"
    )


class MilvusSpec(BaseModel):
    """Milvus: the vectors in a collection of a Milvus server or of Milvus Lite's local file, searched
    exactly (FLAT) by inner product; the index folder names it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["flat"] = "flat"
    uri: str = Field(
        description="a Milvus server's URI, or for Milvus Lite a path ending in .db (recorded absolute; new, "
        "empty or a Milvus Lite database)"
    )
    collection: str | None = Field(
        None, description="a letter or '_' then letters, digits and '_' (default: the output folder's name)"
    )


class MilvusSearchIndex(SearchIndex, backend=BACKEND):
    """A saved index whose vectors live in a Milvus collection; searched exactly by inner product."""

    types = ("flat",)
    exact_types = ("flat",)
    spec_class = MilvusSpec

    @classmethod
    def build(cls, store: EmbeddingStore, spec: MilvusSpec, output: Path, options: BuildOptions) -> Path:
        """Write `store` into the collection `spec` names (the output folder's name by default) and the
        index folder that names it; a collection of other embeddings is replaced only with
        `options.overwrite`. Milvus searches exactly: there is no recall to measure."""
        collection = spec.collection or default_collection(output)
        overwrite, show_progress = options.overwrite, options.show_progress
        return build_milvus_index(store, output, spec.uri, collection, overwrite, show_progress)

    @classmethod
    def summary(cls, meta: dict[str, Any], about: dict[str, Any]) -> str:
        """The collection and where it is."""
        return f" (Milvus collection {meta['collection']!r} at {meta['uri']})"

    def __init__(self, meta: dict[str, Any], ids: list[str], folder: Path, identity: dict[str, Any]):
        self.meta = meta
        self.ids = np.asarray(ids, dtype=object)
        self.folder = folder
        self.identity = identity
        self.spec = IndexSpec(**meta["spec"])
        self.collection = meta["collection"]
        self.client = _client(meta["uri"])
        with _milvus_errors(meta["uri"]):
            self._check_collection(folder, meta["uri"], identity)
            self.client.load_collection(self.collection)  # a released collection cannot be searched

    @classmethod
    def open(
        cls, folder: Path, meta: dict[str, Any], ids: list[str], identity: dict[str, Any], gpu: bool,
        mmap: bool,
    ) -> MilvusSearchIndex:
        """The index of `folder`, whose collection must still hold its embeddings; Milvus searches it,
        so `gpu` is refused (and `mmap`, which is faiss's, does not apply)."""
        if gpu:
            raise InputError(f"{folder} is a Milvus index: Milvus searches it, not faiss on a GPU")
        return cls(meta, ids, folder, identity)

    def _check_collection(self, folder: Path, uri: str, identity: dict[str, Any]) -> None:
        """Refuse an index whose collection is gone or holds other embeddings now."""
        if not self.client.has_collection(self.collection):
            raise DataError([Problem(folder, None, f"Milvus collection {self.collection!r} at {uri} "
                                     "is gone: build the index again")])  # fmt: skip
        saved = self.client.describe_collection(self.collection).get("properties", {}).get(IDENTITY_PROPERTY)
        if saved != digest_of(identity):
            reason = f"Milvus collection {self.collection!r} at {uri} no longer holds its embeddings"
            raise DataError([Problem(folder, None, reason + ": build the index again")])

    @property
    def dimension(self) -> int:
        """The indexed vectors' size."""
        return int(self.meta["dimension"])

    @property
    def rows(self) -> int:
        """Vectors held."""
        return int(self.meta["rows"])

    def set_search_parameters(self, ef_search: int | None = None, nprobe: int | None = None) -> None:
        """Milvus's FLAT search has no parameters: giving one is an error."""
        for field, value in (("ef_search", ef_search), ("nprobe", nprobe)):
            if value is not None:
                raise SpecError(field, value, f"{self.folder} is a Milvus (flat) index; it has no {field}")

    def stored_vectors(self, doc_ids: list[str]) -> np.ndarray | None:
        """None: the vectors are Milvus's, not fetched back (mining encodes what it needs)."""
        return None

    def search(self, queries: np.ndarray, k: int) -> Hits:
        """The top `k` rows per query, from Milvus."""
        if queries.ndim != 2 or queries.shape[1] != self.dimension:
            raise InputError(
                f"query vectors of shape {queries.shape}; the index holds dimension {self.dimension}"
            )
        if k < 1:
            raise InputError(f"k={k}: at least one result per query must be asked for")
        depth = min(k, self.rows, _MAX_TOP_K)
        with _milvus_errors(self.meta["uri"]):
            found = self.client.search(
                self.collection,
                data=np.ascontiguousarray(queries, dtype=np.float32).tolist(),
                limit=depth,
                output_fields=["id"],
                search_params={"metric_type": "IP"},
            )
        scores = np.full((len(queries), depth), -np.inf, dtype=np.float32)
        labels = np.full((len(queries), depth), -1, dtype=np.int64)
        for row, hits in enumerate(found):
            for column, hit in enumerate(hits):
                labels[row, column] = int(hit["id"])
                scores[row, column] = float(hit["distance"])
        return Hits(scores, labels, self.ids)
