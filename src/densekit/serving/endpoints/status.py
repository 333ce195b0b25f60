"""The routes that say how the service is: `/health`, the search page at `/`, `/info` and `/metrics`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from densekit.serving.metrics import CONTENT_TYPE
from densekit.serving.page import SEARCH_PAGE
from densekit.serving.service import SearchService


def add_routes(app: FastAPI, service: SearchService) -> None:
    """`/health` (GET and HEAD) and the page, open; `/info`, and `/metrics` unless `open_metrics`, behind
    the token."""

    async def health() -> dict:
        """Whether the service is up (no token needed); HEAD too, as load balancers' probes ask."""
        return {"status": "ok"}

    app.get("/health")(health)
    app.head("/health", include_in_schema=False)(health)  # one operation in the API description

    def page() -> str:
        return SEARCH_PAGE

    app.get("/", response_class=HTMLResponse, include_in_schema=False)(page)

    app.router.add_api_route("/info", service.info, methods=["GET"], dependencies=service.authorised,
                             route_class_override=service.checked)  # fmt: skip

    def prometheus() -> Response:
        """Every metric in Prometheus' text format."""
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    guarded: dict[str, Any] = {"dependencies": service.authorised, "route_class_override": service.checked}
    app.router.add_api_route("/metrics", prometheus, methods=["GET"], include_in_schema=False,
                             **({} if service.open_metrics else guarded))  # fmt: skip
