"""Documents by id from an SQLite file built from a corpus, so hits carry their title and text without
the corpus held in memory.

The store of an index folder `INDEX` is the file `INDEX.documents.sqlite` beside it. It records the
digest of the corpus it was built from and is rebuilt (atomically) when the corpus changes.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from pathlib import Path

from densekit.data.dataset import Dataset
from densekit.data.records import Document
from densekit.errors import DensekitError
from densekit.io.artefact import write_file_manifest
from densekit.io.atomic import atomic_path
from densekit.io.outputs import check_file_output, is_current
from densekit.progress import progress_bar

log = logging.getLogger("densekit")

KIND = "document store"
_BATCH = 1000


def store_path(index_dir: Path | str) -> Path:
    """Where the document store of an index folder lives."""
    index_dir = Path(index_dir)
    return index_dir.with_name(f"{index_dir.name}.documents.sqlite")


class DocumentsUnavailable(DensekitError, RuntimeError):
    """The store's file was removed, replaced or cannot be read since the store was opened."""


class DocumentStore:
    """Read-only access to the documents of a store file; safe to share between threads (each thread
    opens its own connection). Each read first checks that the file is still the one opened: one removed,
    replaced or unreadable makes the read raise `DocumentsUnavailable`, logged once, and `unavailable`
    say why."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._local = threading.local()
        self._file = _file_identity(os.stat(self.path))
        self.unavailable: str | None = None  # why the documents cannot be read, once a read failed
        self.count = int(self._connection().execute("SELECT COUNT(*) FROM documents").fetchone()[0])

    def _connection(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
            self._local.connection = connection
        return connection

    def __len__(self) -> int:
        return self.count

    def get(self, doc_id: str) -> Document | None:
        """The document with this id, or None."""
        return self.get_many([doc_id]).get(doc_id)

    def get_many(self, doc_ids: list[str]) -> dict[str, Document]:
        """The documents among `doc_ids` that the store holds, by id; `DocumentsUnavailable` when the
        store's file is gone, replaced or unreadable."""
        self._check_file()
        found: dict[str, Document] = {}
        try:
            for start in range(0, len(doc_ids), _BATCH):
                chunk = doc_ids[start : start + _BATCH]
                marks = ",".join("?" * len(chunk))
                rows = self._connection().execute(
                    f"SELECT id, title, text FROM documents WHERE id IN ({marks})", chunk
                )
                for doc_id, title, text in rows:
                    found[doc_id] = Document(id=doc_id, text=text, title=title)
        except sqlite3.Error as err:
            self._fail(f"the document store {self.path} cannot be read: {err}")
        return found

    def _check_file(self) -> None:
        """Raise `DocumentsUnavailable` unless the store's file is the one opened."""
        try:
            now = _file_identity(os.stat(self.path))
        except OSError as err:
            self._fail(f"the document store {self.path} is gone: {err.strerror}")
        if now != self._file:
            self._fail(f"the document store {self.path} was replaced since it was opened")

    def _fail(self, reason: str) -> None:
        """Log `reason` the first time, and raise it."""
        if self.unavailable is None:
            log.error("%s: hits come without titles and texts until the service is restarted", reason)
        self.unavailable = reason
        raise DocumentsUnavailable(reason)


def _file_identity(status: os.stat_result) -> tuple[int, int]:
    """What tells one file from another that takes its name: its device and inode."""
    return status.st_dev, status.st_ino


def build_document_store(dataset: Dataset, path: Path, show_progress: bool = False) -> DocumentStore:
    """Write the store of `dataset`'s corpus to `path`, replacing only a store densekit wrote, and
    open it."""
    path = check_file_output(path, KIND, [dataset.root])
    with atomic_path(path) as tmp:
        connection = sqlite3.connect(tmp)
        connection.execute("CREATE TABLE documents (id TEXT PRIMARY KEY, title TEXT, text TEXT)")
        batch: list[tuple[str, str, str]] = []
        with progress_bar("storing documents", dataset.count_documents(), show_progress) as advance:
            for document in dataset.iter_corpus():
                batch.append((document.id, document.title, document.text))
                if len(batch) == _BATCH:
                    connection.executemany("INSERT INTO documents VALUES (?, ?, ?)", batch)
                    advance(len(batch))
                    batch = []
            connection.executemany("INSERT INTO documents VALUES (?, ?, ?)", batch)
            advance(len(batch))
        connection.commit()
        connection.close()
    write_file_manifest(path, KIND, {"corpus": dataset.corpus_digest()}, {"corpus": str(dataset.corpus_path)})
    return DocumentStore(path)


def open_document_store(dataset: Dataset, path: Path, show_progress: bool = False) -> DocumentStore:
    """The store at `path` when it was built from this very corpus, else a new one built there."""
    if is_current(path, KIND, {"corpus": dataset.corpus_digest()}):
        return DocumentStore(path)
    log.info("building the document store %s from %s", path, dataset.corpus_path)
    return build_document_store(dataset, path, show_progress)
