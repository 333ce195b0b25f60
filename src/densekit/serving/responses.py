"""The service's answers as it writes them: JSON by orjson, and `/search`'s built straight from its hits,
titles and texts bounded."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse

from densekit.retrieval.hit import Hit


class FastJSON(JSONResponse):
    """A JSON answer written by orjson: a search's ten hits with their texts take the standard library's
    encoder 0.12 ms, a fifth of the event loop's time for the request (docs/performance.md).

    By hand rather than FastAPI's `ORJSONResponse`, which FastAPI deprecates (0.165 warns with a
    FastAPIDeprecationWarning for each one made, and for a subclass) in favour of returning a response
    model, which it validates again, field by field, before writing: the cost these answers avoid."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def search_response(hits: list[list[Hit]], took_ms: float, unavailable: str | None,
                    max_text_chars: int) -> JSONResponse:  # fmt: skip
    """`SearchResponse`'s JSON, built straight from the hits: a response model returned instead would be
    validated again, hit by hit, before being written. Titles and texts of at most `max_text_chars`
    characters in all go with it (`texts_within`)."""
    results = [[{"id": h.id, "score": h.score, "title": h.title, "text": h.text} for h in row]
               for row in hits]  # fmt: skip
    left_out = texts_within(results, max_text_chars)
    return FastJSON({"results": results, "took_ms": took_ms, "documents_unavailable": unavailable,
                     "texts_left_out": left_out})  # fmt: skip


def texts_within(results: list[list[dict]], most: int) -> int:
    """Leave out the title and text of hits in `results` (rows of hits as answered) until those left hold
    at most `most` characters: the best ranks of every query keep theirs first (rank 1 of each query,
    then rank 2, ...), and a hit whose title and text do not fit in what is left loses both, where a
    shorter one further down may still fit. Returns how many hits lost theirs.

    Counted in characters, which bound the bytes of the answer: a character is at most 4 bytes of UTF-8
    (6 for a control character JSON escapes), and counting them costs nothing where bytes would mean
    encoding every text once more."""
    sizes = [[len(hit["title"] or "") + len(hit["text"] or "") for hit in row] for row in results]
    if sum(map(sum, sizes)) <= most:
        return 0
    left, left_out = most, 0
    for rank in range(max(map(len, results))):
        for row, row_sizes in zip(results, sizes, strict=True):
            if rank >= len(row) or row_sizes[rank] == 0:
                continue
            if row_sizes[rank] <= left:
                left -= row_sizes[rank]
            else:
                row[rank]["title"] = row[rank]["text"] = None
                left_out += 1
    return left_out
