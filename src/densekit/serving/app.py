"""The HTTP search service: FastAPI routes over a `Retriever` (search, documents, OpenAI's embeddings
API, Prometheus metrics), with a bearer token, limits, and micro-batched encoding behind a bounded queue.

`create_app` puts together what the other modules hold: the service (`service.SearchService`), its
routes (`routes`), its middleware (`middleware`) and its answers to errors (`error_answers`)."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI

from densekit.device import Precision
from densekit.retrieval.retriever import Retriever
from densekit.serving import api_docs, error_answers
from densekit.serving.endpoints import embeddings, search, status
from densekit.serving.metrics import MetricsMiddleware
from densekit.serving.middleware import BodyLimit, HostCheck
from densekit.serving.service import SearchService
from densekit.serving.settings import Batching, Limits

__all__ = ["Batching", "Limits", "create_app"]


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
    service = SearchService(retrievers, api_key, limits, batching, precision, model_name, open_metrics,
                            precision_reason)  # fmt: skip
    app = FastAPI(title="densekit search", lifespan=service.lifespan, docs_url=None, redoc_url=None)
    api_docs.add_api_docs(app)  # /docs and /redoc with their files served here, not from a CDN
    app.state.batcher = service.batcher
    app.state.metrics = service.metrics
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)
    app.add_middleware(HostCheck, allowed=allowed_hosts)
    app.add_middleware(MetricsMiddleware, metrics=service.metrics)  # added last: outermost, sees every status
    error_answers.register(app)
    for routes in (status, search, embeddings):
        routes.add_routes(app, service)
    return app
