"""The service's Prometheus metrics: requests by route and status, their latency, encoding batch sizes,
the queue's depth, and the size of the documents and indexes served."""

from __future__ import annotations

import re
import time
from typing import Any

from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.routing import Match

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
UNMATCHED = "<unmatched>"  # one label for every path no route serves, so a scan cannot add labels
OTHER_METHOD = "<other>"  # one label for every method HTTP does not define, for the same reason
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServiceMetrics:
    """The metrics of one service, in a registry of its own (several services in one process, as in
    tests, count apart)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "densekit_requests", "HTTP requests answered, by route template, method and status code.",
            ["route", "method", "status"], registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "densekit_request_duration_seconds", "Time from a request's arrival to its response, by route.",
            ["route"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.batch_texts = Histogram(
            "densekit_batch_texts", "Texts encoded together in one batch (queries, embeddings inputs).",
            buckets=BATCH_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.batch_seconds = Histogram(
            "densekit_batch_duration_seconds", "Time one encoding batch took, search included.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.queued = Gauge("densekit_queue_texts", "Texts waiting to be encoded.", registry=self.registry)
        self.documents = Gauge("densekit_documents", "Documents in the store served.", registry=self.registry)
        self.index_vectors = Gauge(
            "densekit_index_vectors", "Vectors in each index served, by module.", ["module"],
            registry=self.registry,
        )  # fmt: skip

    def observe_batch(self, texts: int, seconds: float) -> None:
        """Count one encoding batch."""
        self.batch_texts.observe(texts)
        self.batch_seconds.observe(seconds)

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry)


class MetricsMiddleware:
    """ASGI middleware counting every HTTP request by the template of the route that serves it (so
    `/documents/{doc_id}` is one label), its method (one of HTTP's, or OTHER_METHOD) and its status,
    and timing it; outermost, so it sees the 413s and 401s refused before a route runs too."""

    def __init__(self, app: Any, metrics: ServiceMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def sent(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            route = _route_template(scope)
            method = scope["method"] if scope["method"] in METHODS else OTHER_METHOD
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)


def _route_template(scope: dict) -> str:
    """The path template of the route `scope` reached (FastAPI's router notes it in the scope) or would
    reach, whatever its method, or UNMATCHED; without its parameters' convertors (`/documents/{doc_id}`,
    not `{doc_id:path}`)."""
    reached = scope.get("route")
    if isinstance(reached, APIRoute):
        return reached.path_format
    for route in scope["app"].router.routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            return re.sub(r"\{(\w+):\w+\}", r"{\1}", getattr(route, "path", UNMATCHED))
    return UNMATCHED
