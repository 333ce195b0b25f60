"""The HTTP search service: FastAPI routes over a `Retriever`, with a bearer token, limits and
micro-batched query encoding."""

from __future__ import annotations

import contextlib
import hmac
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from densekit.encoding.device import Precision
from densekit.retrieval.retriever import Retriever
from densekit.serving.batcher import MicroBatcher
from densekit.serving.page import SEARCH_PAGE


class Limits(BaseModel):
    """What one request may ask; past a limit it gets 413 (body) or 422 (the rest)."""

    model_config = ConfigDict(extra="forbid")

    max_query_chars: int = Field(2000, ge=1)
    max_k: int = Field(1000, ge=1)
    max_queries: int = Field(64, ge=1)
    max_body_bytes: int = Field(1_000_000, ge=1)


class SearchRequest(BaseModel):
    """`query`: one text or a list of them; `k`: hits per query (10, or the service's limit if lower);
    `module`: which of the served modules encodes the queries (default: the first served); `domain`:
    the queries' domain, which a served fixed route maps to a module."""

    model_config = ConfigDict(extra="forbid")

    query: str | list[str]
    k: int | None = None
    module: str | None = None
    domain: str | None = None


class HitOut(BaseModel):
    """One ranked document."""

    id: str
    score: float
    title: str | None = None
    text: str | None = None


class SearchResponse(BaseModel):
    """Hits per query, in the order the queries came, and the time the search took."""

    results: list[list[HitOut]]
    took_ms: float


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
            await self._refuse(scope, receive, send)
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

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        response = JSONResponse({"detail": self.message}, status_code=413)
        await response(scope, receive, send)


def create_app(retrievers: Retriever | list[Retriever], api_key: str | None, limits: Limits = Limits(),
               max_batch: int = 64, max_wait_ms: float = 5.0,
               precision: Precision = "float32") -> FastAPI:  # fmt: skip
    """The service over one retriever, or several sharing one encoder, each with its own module and
    index (the first answers requests that name no module), its queries encoded under `precision`'s
    autocast. With `api_key`, every route but `/health`, the page at `/` and the OpenAPI pages (which
    hold no data) needs `Authorization: Bearer <api_key>`."""
    served = [retrievers] if isinstance(retrievers, Retriever) else list(retrievers)
    by_module = {r.module: r for r in served}
    if len(by_module) != len(served):
        raise ValueError("two retrievers of the same module: serve each module once")
    retriever = served[0]
    batcher = MicroBatcher(max_batch, max_wait_ms, precision)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="densekit search", lifespan=lifespan)
    app.state.batcher = batcher
    app.add_middleware(_BodyLimit, limit=limits.max_body_bytes)
    bearer = HTTPBearer(auto_error=False)

    def authorised(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if api_key is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health")
    def health() -> dict:
        """Whether the service is up (no token needed)."""
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> str:
        return SEARCH_PAGE

    @app.get("/info", dependencies=[Depends(authorised)])
    def info() -> dict:
        """The model, the module and index that answer by default, the other modules served, the
        documents, the precision queries are encoded at and the limits."""
        return {
            "model": retriever.encoder.source,
            "dimension": retriever.encoder.dimension,
            "active_module": retriever.module,
            "route": None if retriever.route is None else retriever.route.spec.model_dump(),
            "index": _index_info(retriever),
            "modules": {str(r.module): _index_info(r) for r in served[1:]},
            "documents": len(retriever.documents) if retriever.documents is not None else None,
            "query_precision": precision,
            "limits": limits.model_dump(),
        }

    @app.post("/search", dependencies=[Depends(authorised)], response_model=SearchResponse)
    async def search(request: SearchRequest) -> SearchResponse:
        """Hits for one query or a list of them."""
        texts = [request.query] if isinstance(request.query, str) else request.query
        k = request.k if request.k is not None else min(10, limits.max_k)
        _check(k, texts, limits)
        chosen = retriever if request.module is None else by_module.get(request.module)
        if chosen is None:
            names = ", ".join(repr(name) for name in by_module if name is not None) or "none"
            raise _LimitError(f"module {request.module!r} is not served here (modules served: {names})")
        _check_domain(chosen, request.domain)
        start = time.perf_counter()
        hits = await batcher.search(chosen, texts, k, request.domain)
        took = (time.perf_counter() - start) * 1000
        return SearchResponse(results=[[HitOut(**h.__dict__) for h in row] for row in hits], took_ms=took)

    @app.get("/documents/{doc_id}", dependencies=[Depends(authorised)], response_model=HitOut)
    def document(doc_id: str) -> HitOut:
        """A document of the corpus by id (score 0)."""
        if retriever.documents is None:
            raise HTTPException(404, "this service has no documents: start it with --corpus")
        found = retriever.documents.get(doc_id)
        if found is None:
            raise HTTPException(404, f"no document {doc_id!r}")
        return HitOut(id=found.id, score=0.0, title=found.title, text=found.text)

    @app.exception_handler(_LimitError)
    async def over_limit(_: Request, err: _LimitError) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status_code=422)

    return app


class _LimitError(ValueError):
    pass


def _index_info(retriever: Retriever) -> dict:
    index = retriever.index
    return {
        "type": index.meta.get("backend", index.spec.type),
        "rows": index.rows,
        "folder": str(index.folder),
    }


def _check_domain(retriever: Retriever, domain: str | None) -> None:
    """A domain goes with a fixed route, which needs one it knows (or a fallback)."""
    route = retriever.route
    if route is None or route.spec.type != "fixed":
        if domain is not None:
            raise _LimitError("domain: the service routes no queries by domain (it serves no fixed route)")
        return
    if domain not in route.spec.domains and route.spec.fallback is None:
        known = ", ".join(repr(d) for d in route.spec.domains)
        raise _LimitError(f"domain {domain!r} is not routed here (domains: {known})")


def _check(k: int, texts: list[str], limits: Limits) -> None:
    if not 1 <= k <= limits.max_k:
        raise _LimitError(f"k={k}: ask for 1 to {limits.max_k} hits")
    if not 1 <= len(texts) <= limits.max_queries:
        raise _LimitError(f"{len(texts)} queries: send 1 to {limits.max_queries} in one request")
    for number, text in enumerate(texts):
        if len(text) > limits.max_query_chars:
            raise _LimitError(
                f"query {number}: {len(text)} characters, over the limit of {limits.max_query_chars}"
            )
        if not text.strip():
            raise _LimitError(f"query {number} is empty")
