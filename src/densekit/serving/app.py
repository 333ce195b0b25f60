"""The HTTP search service: FastAPI routes over a `Retriever` (search, documents, OpenAI's embeddings
API, Prometheus metrics), with a bearer token, limits, and micro-batched encoding behind a bounded queue."""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import re
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from densekit.device import Precision
from densekit.retrieval.documents import DocumentsUnavailable
from densekit.retrieval.hit import Hit
from densekit.retrieval.retriever import IndexChanged, Retriever
from densekit.serving import api_docs, openai_api
from densekit.serving.batcher import MicroBatcher, Overloaded, TimedOut, Unencodable, default_workers
from densekit.serving.bearer import BearerToken, closing_if_body_unsent
from densekit.serving.checked_route import CheckedRoute
from densekit.serving.checks import (
    bounded_problems,
    is_blank,
    only_a_number,
    shortened,
    shown,
    unencodable_at,
)
from densekit.serving.direct_route import DirectRoute
from densekit.serving.metrics import CONTENT_TYPE, MetricsMiddleware, ServiceMetrics
from densekit.serving.openai_api import EmbeddingsRequest, EmbeddingsResponse
from densekit.serving.page import SEARCH_PAGE

OPENAI_PREFIX = "/v1/"
LOCAL_NAMES = ("localhost",)  # with any name under .localhost and any IP address, always allowed as Host
ANY_HOST = "*"


class Limits(BaseModel):
    """What one request may ask (past a limit it gets 413 for its body, 422 for the rest), how many texts
    may wait to be encoded (past it, 429 with Retry-After) and how long a request may wait for its
    answer (past it, 503 with Retry-After; None: no limit). `max_queries` holds for `/v1/embeddings`
    inputs too; their length limit is `max_input_chars`, long enough for passages (the model truncates
    them to its token limit; the limit only bounds the tokenizer's work). `max_hits` bounds queries
    times k in one `/search` request, and `max_text_chars` the characters of document titles and texts in
    its answer (past it, hits further down come without them, best ranks first: `_search_response`), so a
    small request cannot ask for an answer of many megabytes."""

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


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413, whether or not it says its length."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            closing = closing_if_body_unsent(Headers(scope=scope))  # refused before the body was asked for
            await _error_body(scope["path"], self.message, 413, closing or None)(scope, receive, send)
            return
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # FastAPI passes an HTTPException raised while reading the body on
                raise HTTPException(413, self.message)
            return message

        await self.app(scope, counted, send)

    @property
    def message(self) -> str:
        """The error a request over the limit gets."""
        return f"request body over {self.limit} bytes"


# A Host header's name (or bracketed IPv6 address) and port, as RFC 9110 allows it (its port, RFC 3986's,
# may be empty: `localhost:` is `localhost`); anything else (user info, a path, spaces) is no host of ours.
_HOST = re.compile(r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._~!$&'()*+,;=%-]+))(?::[0-9]{0,5})?")


class _HostCheck:
    """ASGI middleware for the Host header: a request with more than one gets 400 (RFC 9112, 3.2: which
    one a proxy or a check would read is anyone's guess); and against DNS rebinding, where `allowed` is
    given, a request whose Host is not an IP address, not `localhost` (or a name under .localhost) and
    not one of `allowed` gets 403. A web page can point a name of its own at 127.0.0.1 and so reach a
    service on this machine, but its requests then carry that name as Host. starlette's
    TrustedHostMiddleware answers 400 without a reason and would need every address listed; a request
    without a Host header (HTTP/1.0) does not come from a browser and passes."""

    def __init__(self, app: Any, allowed: Sequence[str] | None):
        self.app = app
        names = None if allowed is None else (*LOCAL_NAMES, *allowed)
        self.allowed = None if names is None else {name.lower().rstrip(".") for name in names}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            hosts = [value for name, value in scope.get("headers") or [] if name == b"host"]
            if len(hosts) > 1:
                message = f"{len(hosts)} Host headers: a request carries one"
                await _error_body(scope["path"], message, 400)(scope, receive, send)
                return
            given = hosts[0] if hosts else None
            if self.allowed is None or ANY_HOST in self.allowed or given is None:
                await self.app(scope, receive, send)
                return
            if not self.allows(given.decode("latin-1")):
                message = (f"Host {shown(given.decode('latin-1'))} is not an address of this service nor a "
                           "name it allows (a guard against DNS rebinding): start `densekit serve` with "
                           "--allowed-host NAME to allow a name")  # fmt: skip
                await _error_body(scope["path"], message, 403)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def allows(self, header: str) -> bool:
        """Whether a request with this Host header may be answered."""
        found = _HOST.fullmatch(header.strip())
        if found is None:
            return False
        name = (found["ipv6"] or found["name"]).lower().rstrip(".")
        if name in self.allowed or name.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True  # an address is no name that DNS could rebind


def create_app(retrievers: Retriever | list[Retriever], api_key: str | None, limits: Limits = Limits(),
               batching: Batching = Batching(), precision: Precision = "float32",
               model_name: str | None = None, open_metrics: bool = False,
               precision_reason: str | None = None,
               allowed_hosts: Sequence[str] | None = None) -> FastAPI:  # fmt: skip
    """The service over one retriever, or several sharing one encoder, each with its own module and
    index (the first answers requests that name no module), its texts encoded under `precision`'s
    autocast (chosen for `precision_reason`, which `/info` repeats). `model_name` (default: the model's
    source) is the name `/v1/embeddings` answers to, beside each module's. With `api_key`, every route
    but `/health`, the page at `/`, the OpenAPI pages (which hold no data) and, with `open_metrics`,
    `/metrics` needs `Authorization: Bearer <api_key>`. Given `allowed_hosts` (names; "*" for any), a
    request whose Host header is neither an IP address, localhost nor one of them gets 403 (`serve`
    always gives them; None: no check, for an app mounted in another server); a request of two Host
    headers gets 400 either way."""
    served = [retrievers] if isinstance(retrievers, Retriever) else list(retrievers)
    by_module = {r.module: r for r in served}
    if len(by_module) != len(served):
        raise ValueError("two retrievers of the same module: serve each module once")
    retriever = served[0]
    model_name = model_name or retriever.encoder.source
    embedding_names = openai_api.served_names(model_name, served)
    metrics = ServiceMetrics()
    batcher = MicroBatcher(batching.max_batch, batching.max_wait_ms, precision, limits.max_queued,
                           limits.request_timeout_s, metrics.observe_batch, batching.encode_batch,
                           batching.workers or default_workers(retriever))  # fmt: skip
    metrics.queued.set_function(lambda: batcher.queued)
    metrics.documents.set(len(retriever.documents) if retriever.documents is not None else 0)
    for each in served:
        metrics.index_vectors.labels(str(each.module or "")).set(each.index.rows)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="densekit search", lifespan=lifespan, docs_url=None, redoc_url=None)
    api_docs.add_api_docs(app)  # /docs and /redoc with their files served here, not from a CDN
    app.state.batcher = batcher
    app.state.metrics = metrics
    app.add_middleware(_BodyLimit, limit=limits.max_body_bytes)
    app.add_middleware(_HostCheck, allowed=allowed_hosts)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # added last: outermost, it sees every status
    token = BearerToken(api_key)
    # the token checked before a body is read; HTTPBearer, which checks nothing here, describes it in the
    # API's description
    authorised = [Depends(HTTPBearer(auto_error=False))]
    checked = functools.partial(CheckedRoute, check=token.check)
    # the two routes that answer under load: FastAPI's handling of the requests it would accept, skipped
    direct = functools.partial(DirectRoute, admits=token.as_written, check=token.check)

    async def health() -> dict:
        """Whether the service is up (no token needed); HEAD too, as load balancers' probes ask."""
        return {"status": "ok"}

    app.get("/health")(health)
    app.head("/health", include_in_schema=False)(health)  # one operation in the API description

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> str:
        return SEARCH_PAGE

    def info() -> dict:
        """The model, the module and index that answer by default, the other modules served, the
        documents, the precision texts are encoded at and why, the embeddings API's model names, the
        limits, the batching and the threads the model computes on."""
        runtime = retriever.encoder.runtime
        return {
            "model": retriever.encoder.source,
            "dimension": retriever.encoder.dimension,
            "active_module": retriever.module,
            "route": None if retriever.route is None else retriever.route.spec.model_dump(),
            "index": _index_info(retriever),
            "modules": {str(r.module): _index_info(r) for r in served[1:]},
            "documents": len(retriever.documents) if retriever.documents is not None else None,
            "documents_unavailable": retriever.documents.unavailable if retriever.documents else None,
            "query_precision": runtime.precision if runtime is not None else precision,
            "precision_reason": precision_reason,
            "backend": "onnx" if runtime is not None else "torch",
            "embedding_models": openai_api.model_list(embedding_names),
            "limits": limits.model_dump(),
            "batching": batching.model_dump() | {"workers": batcher.workers},
            "threads": batcher.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        }

    app.router.add_api_route("/info", info, methods=["GET"], dependencies=authorised,
                             route_class_override=checked)  # fmt: skip

    async def search(request: SearchRequest) -> SearchResponse:
        """Hits for one query or a list of them."""
        texts = [request.query] if isinstance(request.query, str) else request.query
        k = request.k if request.k is not None else min(10, limits.max_k)
        _check_k(k, limits)
        _check_texts(texts, limits.max_queries, limits.max_query_chars, "query", "queries")
        _check_hits(len(texts), k, limits)
        chosen = retriever if request.module is None else by_module.get(request.module)
        if chosen is None:
            names = ", ".join(repr(name) for name in by_module if name is not None) or "none"
            raise _LimitError(f"module {shown(request.module)} is not served here (modules served: {names})")
        _check_domain(chosen, request.domain)
        start = time.perf_counter()
        hits = await batcher.search(chosen, texts, k, request.domain)
        took = (time.perf_counter() - start) * 1000
        unavailable = chosen.documents.unavailable if chosen.documents is not None else None
        return _search_response(hits, took, unavailable, limits.max_text_chars)

    app.router.add_api_route("/search", search, methods=["POST"], dependencies=authorised,
                             response_model=SearchResponse, route_class_override=direct)  # fmt: skip

    async def embeddings(request: EmbeddingsRequest) -> EmbeddingsResponse:
        """OpenAI's embeddings API: `model` is a name from `/v1/models`, whose suffix `:query` or
        `:passage` says how the inputs are encoded (as passages without one)."""
        try:
            texts = openai_api.request_texts(request)
            chosen = openai_api.resolve_model(request.model, embedding_names)
        except openai_api.UnknownModel as err:
            raise HTTPException(404, str(err)) from None
        except ValueError as err:
            raise _LimitError(str(err)) from None
        _check_texts(texts, limits.max_queries, limits.max_input_chars, "input", "inputs")
        dimension = chosen.retriever.encoder.dimension
        if request.dimensions is not None and request.dimensions != dimension:
            raise _LimitError(f"dimensions={shown(request.dimensions)}: this model gives {dimension}")
        if chosen.kind == "query":
            _check_domain(chosen.retriever, chosen.domain)
        found = await batcher.embed(chosen.retriever, texts, chosen.kind, chosen.domain)
        body = openai_api.embeddings_body(found.vectors, found.tokens, request.model, request.encoding_format)
        return _FastJSON(body)  # the shape of EmbeddingsResponse, built as it is sent (`_search_response`)

    app.router.add_api_route("/v1/embeddings", embeddings, methods=["POST"],
                             dependencies=authorised, response_model=EmbeddingsResponse,
                             route_class_override=direct)  # fmt: skip

    def models() -> dict:
        """The model names `/v1/embeddings` answers to, in OpenAI's list shape."""
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "densekit"}
                for name in openai_api.model_list(embedding_names)]  # fmt: skip
        return {"object": "list", "data": data}

    app.router.add_api_route("/v1/models", models, methods=["GET"], dependencies=authorised,
                             route_class_override=checked)  # fmt: skip

    def document(doc_id: str) -> HitOut:
        """A document of the corpus by id (score 0); an id may hold `/` (escaped as %2F or not)."""
        if retriever.documents is None:
            raise HTTPException(404, "this service has no documents: start it with --corpus")
        found = retriever.documents.get(doc_id)
        if found is None:
            raise HTTPException(404, f"no document {shown(doc_id)}")
        return HitOut(id=found.id, score=0.0, title=found.title, text=found.text)

    app.router.add_api_route("/documents/{doc_id:path}", document, methods=["GET"], dependencies=authorised,
                             response_model=HitOut, route_class_override=checked)  # fmt: skip

    def prometheus() -> Response:
        """Every metric in Prometheus' text format."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    app.router.add_api_route("/metrics", prometheus, methods=["GET"], include_in_schema=False,
                             **({} if open_metrics else {"dependencies": authorised,
                                                         "route_class_override": checked}))  # fmt: skip

    @app.exception_handler(_LimitError)
    async def over_limit(request: Request, err: _LimitError) -> JSONResponse:
        return _error(request, str(err), 422)

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, err: Overloaded) -> JSONResponse:
        return _error(request, str(err), 429, {"Retry-After": str(err.retry_after)})

    @app.exception_handler(TimedOut)
    async def timed_out(request: Request, err: TimedOut) -> JSONResponse:
        return _error(request, str(err), 503, {"Retry-After": str(err.retry_after)})

    @app.exception_handler(Unencodable)
    async def unencodable(request: Request, err: Unencodable) -> JSONResponse:
        return _error(request, str(err), 422)

    @app.exception_handler(IndexChanged)
    async def index_changed(request: Request, err: IndexChanged) -> JSONResponse:
        return _error(request, str(err), 503)

    @app.exception_handler(DocumentsUnavailable)
    async def documents_unavailable(request: Request, err: DocumentsUnavailable) -> JSONResponse:
        return _error(request, str(err), 503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        if not request.url.path.startswith(OPENAI_PREFIX):
            if isinstance(err.detail, str):
                err.detail = shortened(err.detail)
            return await http_exception_handler(request, err)
        return _error(request, str(err.detail), err.status_code, err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> Response:
        problems = bounded_problems(err.errors())
        if not request.url.path.startswith(OPENAI_PREFIX):
            return JSONResponse({"detail": problems}, status_code=422)
        described = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in problems)
        return _error(request, described, 422)

    return app


def _search_response(hits: list[list[Hit]], took_ms: float, unavailable: str | None,
                     max_text_chars: int) -> JSONResponse:  # fmt: skip
    """`SearchResponse`'s JSON, built straight from the hits: a response model returned instead would be
    validated again, hit by hit, before being written. Titles and texts of at most `max_text_chars`
    characters in all go with it (`_texts_within`)."""
    results = [[{"id": h.id, "score": h.score, "title": h.title, "text": h.text} for h in row]
               for row in hits]  # fmt: skip
    left_out = _texts_within(results, max_text_chars)
    return _FastJSON({"results": results, "took_ms": took_ms, "documents_unavailable": unavailable,
                      "texts_left_out": left_out})  # fmt: skip


def _texts_within(results: list[list[dict]], most: int) -> int:
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


class _FastJSON(JSONResponse):
    """A JSON answer written by orjson: a search's ten hits with their texts take the standard library's
    encoder 0.12 ms, a fifth of the event loop's time for the request (docs/performance.md)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _error(request: Request, message: str, status: int, headers: dict | None = None) -> JSONResponse:
    """An error in densekit's shape (`{"detail": ...}`), or OpenAI's under /v1/."""
    return _error_body(request.url.path, message, status, headers)


def _error_body(path: str, message: str, status: int, headers: dict | None = None) -> JSONResponse:
    """The error answer to a request for `path`: OpenAI's shape under /v1/, densekit's elsewhere; its
    message cut to a bounded length."""
    message = shortened(message)
    body = openai_api.error_body(message, status) if path.startswith(OPENAI_PREFIX) else {"detail": message}
    return JSONResponse(body, status_code=status, headers=headers)


class _LimitError(ValueError):
    pass


def _index_info(retriever: Retriever) -> dict:
    index = retriever.index
    return {
        "type": index.meta.get("backend", index.spec.type),
        "rows": index.rows,
        "folder": str(index.folder),
        "memory_mapped": getattr(index, "mmap", False),
    }


def _check_domain(retriever: Retriever, domain: str | None) -> None:
    """A domain goes with a fixed route, which needs one it knows (or a fallback)."""
    route = retriever.route
    if route is None or not route.strategy.takes_domains:
        if domain is not None:
            raise _LimitError("domain: the service routes no queries by domain (it serves no fixed route)")
        return
    if domain in route.spec.domains or route.spec.fallback is not None:
        return
    known = ", ".join(repr(d) for d in route.spec.domains)
    how = ('send one as "domain" with the queries (/search), or ask /v1/embeddings for a model '
           "NAME:query@DOMAIN (GET /v1/models lists them)")  # fmt: skip
    if domain is None:
        raise _LimitError(f"this service routes queries by their domain, and these came without one: {how}; "
                          f"domains: {known}")  # fmt: skip
    raise _LimitError(f"domain {shown(domain)} is not routed here (domains: {known})")


def _check_k(k: int, limits: Limits) -> None:
    if not 1 <= k <= limits.max_k:
        raise _LimitError(f"k={shown(k)}: ask for 1 to {limits.max_k} hits")


def _check_hits(queries: int, k: int, limits: Limits) -> None:
    """Queries times k within `max_hits`."""
    if queries * k > limits.max_hits:
        raise _LimitError(
            f"{queries} queries x k={k} = {queries * k} hits: ask for at most {limits.max_hits} in one "
            "request (fewer queries, or a smaller k)"
        )


def _check_texts(texts: list[str], most: int, longest: int, what: str, many: str) -> None:
    """`texts` (a request's queries or inputs: `what`, `many` of them) within the limits: at most `most`
    of them, none longer than `longest` characters, none empty."""
    if not 1 <= len(texts) <= most:
        raise _LimitError(f"{len(texts)} {many}: send 1 to {most} in one request")
    for number, text in enumerate(texts):
        if len(text) > longest:
            raise _LimitError(f"{what} {number}: {len(text)} characters, over the limit of {longest}")
        where = unencodable_at(text)
        if where is not None:
            raise _LimitError(f"{what} {number}: not valid Unicode text (a lone surrogate, "
                              f"U+{ord(text[where]):04X}, at character {where})")  # fmt: skip
        if is_blank(text):
            raise _LimitError(f"{what} {number} is empty (only spaces, controls or invisible characters)")
