"""An index held by Milvus (a cluster, or Milvus Lite's local file) instead of a local Faiss file.

`build_milvus_index` writes the embeddings into a Milvus collection (primary key `id`: the row number;
exact inner-product search, FLAT) and a small local index folder that names it: `index.json` records
the backend, URI, collection, rows and dimension beside `ids.txt`, under densekit's manifest with the
identity of the embeddings. Every command that takes an index folder (`search`, `serve`, `mine`)
therefore works unchanged; pointing at a cluster instead of Milvus Lite changes only the URI.

The collection carries the digest of that identity as a property, set only once every row is in: a
collection densekit did not make is never written, one of other embeddings is replaced only with
`overwrite`, and a folder whose collection was since rewritten is refused at load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from densekit.data.hits import Hits
from densekit.diagnostics import DataError, Problem
from densekit.encoding.store import EmbeddingStore
from densekit.index.faiss_index import IDS_FILE, KIND, META_FILE, SearchIndex, _check_finite
from densekit.index.spec import IndexSpec, SpecError
from densekit.io.artefact import artefact_dir, check_artefact_dir
from densekit.io.fingerprint import digest_of
from densekit.io.outputs import OutputError, check_not_input
from densekit.progress import progress_bar

log = logging.getLogger("densekit")

BACKEND = "milvus"
IDENTITY_PROPERTY = "densekit.identity"
_INCOMPLETE = "incomplete:"
_INSERT_BATCH = 2048
_MAX_TOP_K = 16384  # Milvus's limit on hits per query


def _client(uri: str) -> Any:
    try:
        from pymilvus import MilvusClient
        from pymilvus.exceptions import MilvusException
    except ImportError:
        raise RuntimeError("the Milvus backend needs pymilvus: pip install 'densekit[milvus]'") from None

    try:
        return MilvusClient(uri)
    except MilvusException as err:
        raise RuntimeError(f"Milvus at {uri}: {err.message}") from None


def build_milvus_index(
    store: EmbeddingStore,
    output: Path,
    uri: str,
    collection: str,
    overwrite: bool = False,
    show_progress: bool = True,
) -> Path:
    """Write `store` into `collection` at `uri` and the index folder `output` that names it."""
    check_not_input(output, [store.folder])
    check_artefact_dir(output, KIND)
    rows, dimension = len(store), store.dimension
    if rows == 0:
        raise DataError([Problem(store.folder, None, "no embeddings to index")])
    spec = IndexSpec(type="flat")
    identity = {"embeddings": store.identity, "spec": spec.model_dump(), "backend": BACKEND}
    digest = digest_of(identity)
    client = _client(uri)
    from pymilvus import DataType, MilvusClient  # importable: `_client` has checked

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
                    _check_finite(batch, part.stem.with_suffix(".npy"), part.ids, offset)
                    client.insert(
                        collection,
                        [{"id": start + i, "vector": v} for i, v in enumerate(batch.tolist())],
                    )
                    start += len(batch)
                    advance(len(batch))
        client.flush(collection)
        client.alter_collection_properties(collection, properties={IDENTITY_PROPERTY: digest})
    meta = {"spec": spec.model_dump(), "rows": rows, "dimension": dimension, "maxp": store.maxp,
            "backend": BACKEND, "uri": uri, "collection": collection}  # fmt: skip
    about = {**store.about, "embeddings": str(store.folder)}
    with artefact_dir(output, KIND, identity, about) as tmp:
        (tmp / IDS_FILE).write_text("\n".join(store.ids()) + "\n", encoding="utf-8")
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return Path(output)


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


class MilvusSearchIndex(SearchIndex):
    """A saved index whose vectors live in a Milvus collection; searched exactly by inner product."""

    def __init__(self, meta: dict[str, Any], ids: list[str], folder: Path, identity: dict[str, Any]):
        self.meta = meta
        self.ids = np.asarray(ids, dtype=object)
        self.folder = folder
        self.identity = identity
        self.spec = IndexSpec(**meta["spec"])
        self.collection = meta["collection"]
        self.client = _client(meta["uri"])
        if not self.client.has_collection(self.collection):
            raise DataError([Problem(folder, None, f"Milvus collection {self.collection!r} at {meta['uri']} "
                                     "is gone: build the index again")])  # fmt: skip
        saved = self.client.describe_collection(self.collection).get("properties", {}).get(IDENTITY_PROPERTY)
        if saved != digest_of(identity):
            reason = f"Milvus collection {self.collection!r} at {meta['uri']} no longer holds its embeddings"
            raise DataError([Problem(folder, None, reason + ": build the index again")])
        self.client.load_collection(self.collection)  # a released collection cannot be searched

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
            raise ValueError(
                f"query vectors of shape {queries.shape}; the index holds dimension {self.dimension}"
            )
        if k < 1:
            raise ValueError(f"k={k}: at least one result per query must be asked for")
        depth = min(k, self.rows, _MAX_TOP_K)
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
