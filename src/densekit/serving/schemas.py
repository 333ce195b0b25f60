"""The shapes of `/search` and `/documents/{id}`: what a request sends and what it is answered, as the
API's description gives them (OpenAI's embeddings shapes are in `openai_api`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

from densekit.serving.checks import only_a_number


class SearchRequest(BaseModel):
    """`query`: one text or a list of them; `k`: hits per query (10, or the service's limit if lower);
    `module`: which of the served modules encodes the queries (default: the first served); `domain`:
    the queries' domain, which a served fixed route maps to a module."""

    model_config = ConfigDict(extra="forbid")

    query: str | list[str]
    k: int | None = None
    module: str | None = None
    domain: str | None = None

    @field_validator("k", mode="before")
    @classmethod
    def _a_number(cls, value: object) -> object:
        return only_a_number(value)


class HitOut(BaseModel):
    """One ranked document."""

    id: str
    score: float
    title: str | None = None
    text: str | None = None


class SearchResponse(BaseModel):
    """Hits per query, in the order the queries came, and the time the search took; where the document
    store could not be read, hits without titles and texts, and why in `documents_unavailable`; the
    hits that came without their title and text because the answer held the most characters of them
    it may (the service's `max_text_chars`), counted in `texts_left_out` (`GET /documents/{id}` gives one)."""

    results: list[list[HitOut]]
    took_ms: float
    documents_unavailable: str | None = None
    texts_left_out: int = 0
