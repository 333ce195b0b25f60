"""MS MARCO-style tab-separated collections (`id<TAB>text` or `id<TAB>title<TAB>text`) and queries."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from densekit.data.entries import EntryChecker
from densekit.data.lines import iter_lines
from densekit.data.records import Document
from densekit.diagnostics import Diagnostics


def _iter_rows(path: Path, diagnostics: Diagnostics, widths: tuple[int, ...]) -> Iterator[tuple[int, list]]:
    expected = " or ".join(str(w) for w in widths)
    for lineno, line in iter_lines(path):
        if not line.strip():
            diagnostics.error(path, lineno, "blank line")
            continue
        columns = line.split("\t")
        if len(columns) not in widths:
            diagnostics.error(
                path, lineno, f"expected {expected} tab-separated columns, found {len(columns)}"
            )
            continue
        yield lineno, columns


def iter_tsv_corpus(path: Path, diagnostics: Diagnostics) -> Iterator[Document]:
    """Stream the documents of a tab-separated collection."""
    checker = EntryChecker(path, diagnostics, "documents")
    for lineno, columns in _iter_rows(path, diagnostics, (2, 3)):
        doc_id = checker.check_id(columns[0], lineno)
        if doc_id is None:
            continue
        title, text = (columns[1], columns[2]) if len(columns) == 3 else ("", columns[1])
        checker.note_text(f"{title} {text}", lineno)
        yield Document(doc_id, text, title)
    checker.finish()


def read_tsv_queries(path: Path, diagnostics: Diagnostics) -> dict[str, str]:
    """Read tab-separated queries into `{query id: text}`."""
    checker = EntryChecker(path, diagnostics, "queries")
    queries: dict[str, str] = {}
    for lineno, (raw_id, text) in _iter_rows(path, diagnostics, (2,)):
        query_id = checker.check_id(raw_id, lineno)
        if query_id is None:
            continue
        checker.note_text(text, lineno)
        queries[query_id] = text
    checker.finish()
    return queries
