"""The service's direct routes (`densekit.serving.direct_route`): every request gets the answer FastAPI's own
handling of the same route gives, and the requests FastAPI would accept skip that handling."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel

from densekit.retrieval.retriever import Retriever
from densekit.serving import direct_route
from densekit.serving.app import create_app
from densekit.serving.direct_route import DirectRoute

from .service_fixtures import TOKEN

JSON = "application/json"
BEARER = f"Bearer {TOKEN}"

# (path, body, content type, Authorization, answered directly): the accepted ones first
CASES = [
    ("/search", {"query": "alpha beta", "k": 3}, JSON, BEARER, True),
    ("/search", {"query": ["alpha", "gamma delta"]}, "application/json; charset=utf-8", BEARER, True),
    ("/search", {"query": "alpha", "k": 10.0}, JSON, BEARER, True),
    ("/search", {"query": "alpha", "module": "nope"}, JSON, BEARER, True),  # refused by the endpoint
    ("/search", {"query": "alpha", "k": 0}, JSON, BEARER, True),
    ("/search", {"query": "   "}, JSON, BEARER, True),
    ("/v1/embeddings", {"input": ["alpha", "beta"], "model": "MODEL"}, JSON, BEARER, True),
    ("/v1/embeddings", {"input": "alpha", "model": "MODEL", "encoding_format": "base64"}, JSON, BEARER, True),
    ("/v1/embeddings", {"input": "alpha", "model": "unknown"}, JSON, BEARER, True),
    ("/v1/embeddings", {"input": [], "model": "MODEL"}, JSON, BEARER, True),  # refused by the endpoint
    ("/search", {"query": "alpha"}, JSON, None, False),
    ("/search", {"query": "alpha"}, JSON, f"bearer {TOKEN}", False),
    ("/search", {"query": "alpha"}, JSON, f"Bearer {TOKEN}x", False),
    ("/search", {"query": "alpha"}, JSON, "Bearer ", False),
    ("/search", {"query": "alpha"}, None, BEARER, False),
    ("/search", {"query": "alpha"}, "text/plain", BEARER, False),
    ("/search", {"query": "alpha", "extra": 1}, JSON, BEARER, False),
    ("/search", {"query": "alpha", "k": True}, JSON, BEARER, False),
    ("/search", {"k": 3}, JSON, BEARER, False),
    ("/search", b"", JSON, BEARER, False),
    ("/search", b'{"query": "alpha"', JSON, BEARER, False),
    ("/search", b'{"query": "a\\ud800b"}', JSON, BEARER, False),  # a lone surrogate, escaped
    ("/search", b'{"query": "alpha", "k": NaN}', JSON, BEARER, False),
    ("/search", b'\xef\xbb\xbf{"query": "alpha"}', JSON, BEARER, False),  # a byte order mark
    ("/search", '{"query": "alpha"}'.encode("utf-16"), JSON, BEARER, False),
    ("/search", b'{"query": "\xff"}', JSON, BEARER, False),
    ("/v1/embeddings", {"input": "alpha"}, JSON, BEARER, False),
]


def _answers(app: FastAPI, model: str) -> list[tuple[int, object]]:
    """Each case's status and body (its `took_ms` left out: a time)."""
    answers = []
    with TestClient(app) as service:
        for path, body, content_type, authorization, _ in CASES:
            if isinstance(body, dict):
                body = json.dumps(body).replace('"MODEL"', json.dumps(model)).encode()
            headers = {
                name: value
                for name, value in (("Content-Type", content_type), ("Authorization", authorization))
                if value is not None
            }
            answer = service.post(path, content=body, headers=headers)
            shown = answer.json()
            if isinstance(shown, dict):
                shown.pop("took_ms", None)
            answers.append((answer.status_code, shown))
    return answers


def _direct_routes(app: FastAPI) -> list[DirectRoute]:
    return [route for route in app.routes if isinstance(route, DirectRoute)]


def test_direct_routes_answer_every_request_as_fastapi_does(retriever: Retriever):
    direct_app = create_app(retriever, TOKEN)
    routes = _direct_routes(direct_app)
    assert sorted(route.path for route in routes) == ["/search", "/v1/embeddings"]
    went_standard: list[str] = []
    for route in routes:
        standard = route.standard

        async def counted(scope, receive, send, standard=standard):
            went_standard.append(scope["path"])
            await standard(scope, receive, send)

        route.standard = counted
    model = retriever.encoder.source
    direct = _answers(direct_app, model)
    expected_standard = [path for path, *_, answered_directly in CASES if not answered_directly]
    assert went_standard == expected_standard

    fastapi_app = create_app(retriever, TOKEN)
    for route in _direct_routes(fastapi_app):
        route.app = route.standard  # FastAPI's handling for every request
    assert direct == _answers(fastapi_app, model)
    statuses = [status for status, _ in direct]
    assert statuses[:3] == [200, 200, 200] and 401 in statuses and 422 in statuses


class _Body(BaseModel):
    text: str


def test_a_direct_route_takes_one_body_model_and_nothing_else():
    async def with_query(body: _Body, k: int = 1) -> None: ...

    async def without_body(k: int = 1) -> None: ...

    for endpoint in (with_query, without_body):
        with pytest.raises(ValueError, match="one body model and nothing else"):
            DirectRoute("/x", endpoint, methods=["POST"], admits=lambda request: True)


def _sent_for_cut_body(app: FastAPI) -> list[int]:
    """The statuses `app` sends for a /search whose client goes away before its body arrives."""
    headers = [(b"host", b"127.0.0.1"), (b"authorization", BEARER.encode()), (b"content-type", JSON.encode()),
               (b"content-length", b"40")]  # fmt: skip
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/search", "raw_path": b"/search", "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}  # fmt: skip
    sent: list[int] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            sent.append(message["status"])

    asyncio.run(app(scope, receive, send))
    return sent


def test_a_body_cut_short_gets_what_fastapi_answers(retriever: Retriever):
    fastapi_app = create_app(retriever, TOKEN)
    for route in _direct_routes(fastapi_app):
        route.app = route.standard
    expected = _sent_for_cut_body(fastapi_app)
    assert expected == [400]
    assert _sent_for_cut_body(create_app(retriever, TOKEN)) == expected


def test_where_fastapis_routes_are_not_as_read_the_direct_routes_answer_fastapis_way(
    retriever: Retriever, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    model = retriever.encoder.source
    expected = _answers(create_app(retriever, TOKEN), model)
    made = APIRoute.__init__

    def without_body_field(self: APIRoute, *args, **kwargs) -> None:  # a FastAPI that no longer keeps it
        made(self, *args, **kwargs)
        del self.body_field

    monkeypatch.setattr(APIRoute, "__init__", without_body_field)
    monkeypatch.setattr(direct_route, "_fallback_said", False)
    with caplog.at_level(logging.WARNING, logger="densekit"):
        apps = [create_app(retriever, TOKEN), create_app(retriever, TOKEN)]
    said = [record.getMessage() for record in caplog.records if "direct routes" in record.getMessage()]
    assert len(said) == 1 and "body_field" in said[0], said  # once, for both routes of both apps
    routes = _direct_routes(apps[0])
    assert len(routes) == 2 and all(route.app is route.standard for route in routes)
    assert _answers(apps[0], model) == expected
