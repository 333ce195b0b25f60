"""BEIR's JSON-lines files: corpus.jsonl (`_id`, `title`, `text`) and queries.jsonl (`_id`, `text`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from densekit.data.entries import EntryChecker
from densekit.data.lines import iter_lines
from densekit.data.records import Document
from densekit.diagnostics import Diagnostics


def _iter_objects(path: Path, diagnostics: Diagnostics) -> Iterator[tuple[int, dict]]:
    """Yield `(line number, object)` for each JSON object line; report malformed and blank lines."""
    blank: list[int] = []
    for lineno, line in iter_lines(path):
        if not line.strip():
            blank.append(lineno)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            diagnostics.error(path, lineno, f"malformed JSON: {err.msg} at column {err.colno}")
            continue
        if not isinstance(obj, dict):
            diagnostics.error(path, lineno, f"expected a JSON object, found {type(obj).__name__}")
            continue
        yield lineno, obj
    if blank:
        shown = ", ".join(str(n) for n in blank[:10])
        diagnostics.warn(path, None, f"{len(blank)} blank lines skipped (lines {shown})")


def _string_field(
    obj: dict, key: str, path: Path, lineno: int, diagnostics: Diagnostics, required: bool
) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            diagnostics.error(path, lineno, f'missing "{key}"')
            return None
        return ""
    if not isinstance(value, str):
        diagnostics.error(path, lineno, f'"{key}" must be a string, not {type(value).__name__}')
        return None
    return value


def _iter_entries(path: Path, diagnostics: Diagnostics, noun: str, titled: bool) -> Iterator[Document]:
    """Entries with `_id` and `text` (and, when `titled`, an optional `title`), checked line by line."""
    checker = EntryChecker(path, diagnostics, noun)
    for lineno, obj in _iter_objects(path, diagnostics):
        if "_id" not in obj:
            diagnostics.error(path, lineno, 'missing "_id"')
            continue
        entry_id = checker.check_id(obj["_id"], lineno)
        text = _string_field(obj, "text", path, lineno, diagnostics, required=True)
        title = _string_field(obj, "title", path, lineno, diagnostics, required=False) if titled else ""
        if entry_id is None or text is None or title is None:
            continue
        checker.note_text(f"{title} {text}", lineno)
        yield Document(entry_id, text, title)
    checker.finish()


def iter_jsonl_corpus(path: Path, diagnostics: Diagnostics) -> Iterator[Document]:
    """Stream the documents of a BEIR corpus.jsonl, one line at a time."""
    return _iter_entries(path, diagnostics, "documents", titled=True)


def read_jsonl_queries(path: Path, diagnostics: Diagnostics) -> dict[str, str]:
    """Read a BEIR queries.jsonl into `{query id: text}`."""
    return {query.id: query.text for query in _iter_entries(path, diagnostics, "queries", titled=False)}
