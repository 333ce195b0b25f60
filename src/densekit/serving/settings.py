"""A service's settings: what one request may ask (`Limits`), how texts are gathered and encoded
(`Batching`) and what a connection may take (`ConnectionLimits`). Only pydantic is imported, so the
command line builds them from its options before anything heavy loads."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# h11's default bound on the bytes of a request line and headers (or trailers) that have not all
# arrived, which uvicorn's h11 protocol applies and `http_protocol.BoundedHttpToolsProtocol` too
MAX_HEADER_BYTES = 16 * 1024


class Limits(BaseModel):
    """What one request may ask (past a limit it gets 413 for its body, 422 for the rest), how many texts
    may wait to be encoded (past it, 429 with Retry-After) and how long a request may wait for its
    answer (past it, 503 with Retry-After; None: no limit). `max_queries` holds for `/v1/embeddings`
    inputs too; their length limit is `max_input_chars`, long enough for passages (the model truncates
    them to its token limit; the limit only bounds the tokenizer's work). `max_hits` bounds queries
    times k in one `/search` request, and `max_text_chars` the characters of document titles and texts in
    its answer (past it, hits further down come without them, best ranks first:
    `responses.texts_within`), so a small request cannot ask for an answer of many megabytes."""

    model_config = ConfigDict(extra="forbid")

    max_query_chars: int = Field(2000, ge=1)
    max_input_chars: int = Field(100_000, ge=1)
    max_k: int = Field(1000, ge=1)
    max_queries: int = Field(64, ge=1)
    max_hits: int = Field(10_000, ge=1)
    max_body_bytes: int = Field(1_000_000, ge=1)
    max_text_chars: int = Field(1_000_000, ge=0)
    max_queued: int = Field(1024, ge=1)
    request_timeout_s: float | None = Field(30.0, gt=0)


class Batching(BaseModel):
    """How concurrent requests' texts are gathered and encoded (`MicroBatcher`): at most `max_batch`
    texts together, waiting at most `max_wait_ms` for company while the service is under concurrent load,
    at most `encode_batch` at a time through the model (`Retriever.search(..., batch_size=encode_batch)`
    gives the same vectors for the same texts), by `workers` batches at once (None: `default_workers`,
    two on a CPU, one on a GPU)."""

    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(64, ge=1)
    max_wait_ms: float = Field(5.0, ge=0)
    encode_batch: int = Field(32, ge=1)
    workers: int | None = Field(None, ge=1)


class ConnectionLimits(BaseModel):
    """A request's line and headers must all arrive within `header_timeout_s` of its first byte, and its
    body within `body_timeout_s` of its headers (past either, 408 and the connection closed); a
    connection with no request under way is closed after `idle_timeout_s` without one. At most
    `max_connections` are open: past it, the one that has waited longest for a request is closed to make
    way (the new one is refused when every one has a request under way)."""

    model_config = ConfigDict(extra="forbid")

    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    idle_timeout_s: float = Field(5.0, gt=0)
    max_connections: int = Field(1000, ge=1)
