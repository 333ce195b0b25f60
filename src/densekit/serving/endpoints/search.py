"""The search routes: `POST /search` and `GET /documents/{id}`."""

from __future__ import annotations

import time

from fastapi import FastAPI, HTTPException

from densekit.serving.checks import check_domain, check_hits, check_k, check_texts, shown
from densekit.serving.responses import search_response
from densekit.serving.schemas import HitOut, SearchRequest, SearchResponse
from densekit.serving.service import SearchService


def add_routes(app: FastAPI, service: SearchService) -> None:
    """`/search` (a direct route) and `/documents/{id}`, behind the token."""
    limits = service.limits

    async def search(request: SearchRequest) -> SearchResponse:
        """Hits for one query or a list of them."""
        texts = [request.query] if isinstance(request.query, str) else request.query
        k = request.k if request.k is not None else min(10, limits.max_k)
        check_k(k, limits)
        check_texts(texts, limits.max_queries, limits.max_query_chars, "query", "queries")
        check_hits(len(texts), k, limits)
        chosen = service.retriever_of(request.module)
        check_domain(chosen, request.domain)
        start = time.perf_counter()
        hits = await service.batcher.search(chosen, texts, k, request.domain)
        took = (time.perf_counter() - start) * 1000
        unavailable = chosen.documents.unavailable if chosen.documents is not None else None
        return search_response(hits, took, unavailable, limits.max_text_chars)  # type: ignore[return-value]

    app.router.add_api_route("/search", search, methods=["POST"], dependencies=service.authorised,
                             response_model=SearchResponse, route_class_override=service.direct)  # fmt: skip

    def document(doc_id: str) -> HitOut:
        """A document of the corpus by id (score 0); an id may hold `/` (escaped as %2F or not)."""
        documents = service.retriever.documents
        if documents is None:
            raise HTTPException(404, "this service has no documents: start it with --corpus")
        found = documents.get(doc_id)
        if found is None:
            raise HTTPException(404, f"no document {shown(doc_id)}")
        return HitOut(id=found.id, score=0.0, title=found.title, text=found.text)

    app.router.add_api_route("/documents/{doc_id:path}", document, methods=["GET"],
                             dependencies=service.authorised, response_model=HitOut,
                             route_class_override=service.checked)  # fmt: skip
