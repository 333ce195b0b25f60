"""One ranked document, as the Retriever and the service's client give it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hit:
    """One ranked document; `title` and `text` when the retriever has the documents."""

    id: str
    score: float
    title: str | None = None
    text: str | None = None
