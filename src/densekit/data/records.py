"""The shapes that flow between stages: documents, relevance judgements and ranked runs."""

from __future__ import annotations

from dataclasses import dataclass

# query id -> document id -> graded relevance
Qrels = dict[str, dict[str, int]]
# query id -> document id -> score; runs made by a search list each query's documents best first
Run = dict[str, dict[str, float]]


@dataclass(frozen=True, slots=True)
class Document:
    """A corpus entry. Passages are encoded and indexed as `title + " " + text`."""

    id: str
    text: str
    title: str = ""

    @property
    def full_text(self) -> str:
        """Title and text joined by a space, as BEIR and MTEB encode them."""
        return f"{self.title} {self.text}".strip() if self.title else self.text


def id_problem(value: object) -> str | None:
    """Why `value` cannot be an id, or None when it can.

    Ids travel through TREC runs and qrels, whose columns are whitespace-separated, so an id holding
    whitespace could not be written back out faithfully.
    """
    if isinstance(value, bool) or not isinstance(value, str | int):
        return f"id must be a string, not {type(value).__name__}"
    text = str(value)
    if not text:
        return "id is empty"
    if any(ch.isspace() for ch in text):
        return f"id {text!r} contains whitespace, which TREC run and qrels files cannot hold"
    return None
