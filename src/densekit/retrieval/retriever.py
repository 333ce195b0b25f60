"""The one object that searches: a model (with its module), an index and, optionally, the documents.

The `search` command, the recipes' search step, the benchmark, the quickstart and the HTTP service all
go through it.
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

import numpy as np

from densekit.data.dataset import Dataset
from densekit.data.records import Document, Run
from densekit.device import Precision
from densekit.encoding.embed import embed_texts, embed_tokens
from densekit.errors import DensekitError, InputError
from densekit.index.base import SearchIndex
from densekit.models.config import EncoderOptions
from densekit.models.encoder import OWN, DenseEncoder, ModuleChoice
from densekit.progress import progress_bar
from densekit.retrieval.dense import check_compatible
from densekit.retrieval.documents import DocumentStore, DocumentsUnavailable
from densekit.retrieval.hit import Hit
from densekit.routing.model_or_route import load_model_or_route
from densekit.routing.route import Route

log = logging.getLogger("densekit")


class IndexChanged(DensekitError, RuntimeError):
    """A memory-mapped index file was changed in place (truncated, say) while it was searched."""


class _MappedFile:
    """The file a memory-mapped index reads, held open so that its size and time of change can be
    checked before each search: searching a mapping whose file was truncated kills the process (SIGBUS),
    which no exception handler sees. A file replaced under the same name (as `densekit index
    --overwrite` does) leaves the mapping intact and is no change here."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)
        self.loaded = self._state()
        self.changed: str | None = None

    def _state(self) -> tuple[int, int]:
        status = os.fstat(self.fd)
        return status.st_size, status.st_mtime_ns

    def check(self) -> None:
        """Raise `IndexChanged` (logged the first time) if the file changed since it was mapped."""
        if self.changed is None:
            now = self._state()
            if now == self.loaded:
                return
            self.changed = (
                f"the memory-mapped index file {self.path} was changed in place while served "
                f"({self.loaded[0]} bytes when loaded, {now[0]} now): searches are refused until the service "
                "is restarted (replace a served index with `densekit index --overwrite`, which writes a new "
                "file)"
            )
            log.error("%s", self.changed)
        raise IndexChanged(self.changed)


class Retriever:
    """Ranked documents for queries. Safe to call from several threads at once when the encoder is in
    inference mode (`open` puts it there): nothing shared changes per call. The retriever encodes with
    `module` (by default the encoder's own), whose index it must be (the base's, for a query-only
    module); several retrievers may share one encoder, each with its own module."""

    def __init__(
        self,
        encoder: DenseEncoder,
        index: SearchIndex,
        documents: DocumentStore | None = None,
        dataset: Dataset | None = None,
        route: Route | None = None,
        module: ModuleChoice = OWN,
    ):
        name = encoder.chosen(module)
        if route is not None and (route.encoder is not encoder or name is not None):
            raise InputError("a route searches an index of the base's passages: give its own encoder, with "
                             "no module")  # fmt: skip
        check_compatible(encoder, index, dataset, name)
        self.encoder = encoder
        self.module = name
        self.route = route
        self.index = index
        self.documents = documents
        self._mapped = _MappedFile(index.mapped_file) if index.mapped_file is not None else None

    @classmethod
    def open(
        cls,
        model: str,
        index_dir: Path | str,
        corpus: Path | str | None = None,
        module: Path | str | None = None,
        device: str = "auto",
        gpu_index: bool = False,
        show_progress: bool = False,
        mmap_index: bool = False,
    ) -> Retriever:
        """Load the model (with `module` on it) in inference mode, the index and, given the `corpus`
        collection the index was built from, its document store (built beside the index the first
        time), the index memory-mapped with `mmap_index`. `model` may be a route folder: its base and
        modules, routing each query."""
        options = EncoderOptions(module=None if module is None else Path(module))
        encoder, route = load_model_or_route(model, device, options)
        if route is None:
            encoder.eval()
        return cls.over(encoder, index_dir, corpus, gpu_index, show_progress, route, mmap_index)

    @classmethod
    def over(
        cls,
        encoder: DenseEncoder,
        index_dir: Path | str,
        corpus: Path | str | None = None,
        gpu_index: bool = False,
        show_progress: bool = False,
        route: Route | None = None,
        mmap_index: bool = False,
        module: ModuleChoice = OWN,
    ) -> Retriever:
        """A retriever of `encoder` with `module` (by default its own), or of `route` on it, over a saved
        index and the documents of `corpus`; several may share one encoder, each with its own module
        (`serve`)."""
        from densekit.retrieval.documents import open_document_store, store_path

        index = SearchIndex.load(index_dir, gpu=gpu_index, mmap=mmap_index)
        dataset = Dataset.open(corpus) if corpus is not None else None
        documents = None
        if dataset is not None:
            check_compatible(encoder, index, dataset, module)  # before building a store of the wrong corpus
            documents = open_document_store(dataset, store_path(index_dir), show_progress)
        return cls(encoder, index, documents, dataset, route, module)

    def encode_queries(
        self,
        texts: list[str],
        batch_size: int = 64,
        precision: Precision = "float32",
        show_progress: bool = False,
        domains: list[str | None] | None = None,
        token_ids: list[list[int]] | None = None,
    ) -> np.ndarray:
        """The query vectors of `texts`, in their order; with a route, routed (by `domains`, one per text,
        for a fixed route). `token_ids`, the texts' `encoder.tokenize(texts, "query")` where the caller
        has it already, spares tokenizing them again."""
        if self.route is not None:
            return self.route.encode_queries(texts, domains, batch_size, precision, token_ids)
        if domains is not None:
            raise InputError("domains choose modules only through a route")
        with progress_bar("encoding queries", len(texts), show_progress) as advance:
            if token_ids is None:
                return embed_texts(
                    self.encoder, texts, "query", batch_size, precision, advance, module=self.module
                )
            return embed_tokens(
                self.encoder, token_ids, "query", batch_size, precision, advance, module=self.module
            )

    def search_run(
        self,
        queries: dict[str, str],
        k: int = 1000,
        batch_size: int = 64,
        precision: Precision = "float32",
        skip_self: bool = True,
        show_progress: bool = False,
        domain: str | None = None,
    ) -> Run:
        """The top `k` documents for each query, by query id, as a run (a document whose id is the
        query's left out with `skip_self`, as BEIR does); `domain` is the collection's, for a fixed route."""
        query_ids = list(queries)
        domains = None if domain is None else [domain] * len(query_ids)
        texts = [queries[q] for q in query_ids]
        vectors = self.encode_queries(texts, batch_size, precision, show_progress, domains)
        return self.index.search_run(vectors, query_ids, k, skip_self)

    def search(self, queries: str | list[str], k: int = 10, batch_size: int = 64) -> list[list[Hit]]:
        """Ranked hits for each query text (a single text is a list of one), with titles and texts when
        the retriever has the documents; the queries are sorted by length and run through the model
        `batch_size` at a time (the service's `encode_batch`: the same batches give the same bits)."""
        texts = [queries] if isinstance(queries, str) else list(queries)
        return self.hits(self.encode_queries(texts, batch_size), k)

    def hits(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        """Ranked hits for query vectors made by `encode_queries`; without titles and texts when the
        document store cannot be read (`documents.unavailable` says why). A memory-mapped index whose
        file changed in place since it was loaded raises `IndexChanged` rather than being searched."""
        if self._mapped is not None:
            self._mapped.check()
        keys = [str(i) for i in range(len(vectors))]
        run = self.index.search_run(vectors, keys, k, skip_self=False)
        ranked = [list(run.get(key, {}).items()) for key in keys]
        found = self._documents([d for hits in ranked for d, _ in hits])
        results = []
        for hits in ranked:
            row = []
            for doc_id, score in hits:
                document = found.get(doc_id)
                title, text = (document.title, document.text) if document else (None, None)
                row.append(Hit(doc_id, float(score), title, text))
            results.append(row)
        return results

    def _documents(self, doc_ids: list[str]) -> dict[str, Document]:
        """The documents of `doc_ids` that the store holds; none without a store or when it cannot be
        read (the store logs that once)."""
        if self.documents is None:
            return {}
        try:
            return self.documents.get_many(doc_ids)
        except DocumentsUnavailable:
            return {}
