"""A FastAPI route with a shorter way through for the requests a service answers most: FastAPI describes,
validates and refuses as the route declares, but a request it would accept is answered without its
per-request machinery.

By hand: FastAPI solves a route's dependencies, parses the body with the standard library's JSON reader
and validates the result, two exit stacks around it, for every request; at 32 searches in flight that
took about 0.1 ms of the event loop's 0.65 a request (docs/performance.md, "Fourth round"), the event
loop being the one thread every request passes. FastAPI has no switch for a leaner path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message, Receive, Scope, Send

from densekit.serving.checked_route import CheckedRoute

JSON_MEDIA_TYPE = "application/json"


class DirectRoute(CheckedRoute):
    """A `CheckedRoute` whose endpoint takes one body model and nothing else, answered directly where
    `admits(request)` (what `check` and its dependencies ask, passed: e.g. the bearer token as written),
    the body is declared JSON and pydantic accepts it from its bytes: the endpoint is called with the
    model. Any other request (no token, another content type, a body the model refuses, JSON the standard
    library reads otherwise) goes FastAPI's way (`standard`), its `check` first, then dependencies and
    all, so every refusal is FastAPI's own or the check's."""

    def __init__(self, path: str, endpoint: Callable[..., Any], *, admits: Callable[[Request], bool],
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(path, endpoint, **kwargs)
        dependant = self.dependant
        others = (dependant.path_params, dependant.query_params, dependant.header_params,
                  dependant.cookie_params)  # fmt: skip
        if len(dependant.body_params) != 1 or any(others) or self.body_field is None:
            raise ValueError(f"{path}: a direct route's endpoint takes one body model and nothing else")
        model = self.body_field.field_info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ValueError(f"{path}: a direct route's body is a pydantic model, not {model!r}")
        self.model: type[BaseModel] = model
        self.admits = admits
        self.standard = self.app  # FastAPI's handling, for everything not answered directly
        self.app = self.answer

    async def answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI application of this route."""
        request = Request(scope, receive, send)
        if not (self.admits(request) and _declares_json(request.headers.get("content-type"))):
            await self.standard(scope, receive, send)
            return
        try:
            body = await request.body()
        except ClientDisconnect:  # FastAPI answers a body cut short its own way (uvicorn repeats the news)
            await self.standard(scope, receive, send)
            return
        try:
            parsed = self.model.model_validate_json(body)
        except ValidationError:
            await self.standard(scope, _replayed(body, receive), send)
            return
        response = await self.endpoint(parsed)
        await response(scope, receive, send)


def _declares_json(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (parameters such as a charset aside)."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE


def _replayed(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands FastAPI the body already read, as one message, then what `receive` says
    (a disconnect)."""
    unread = True

    async def replay() -> Message:
        nonlocal unread
        if unread:
            unread = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
