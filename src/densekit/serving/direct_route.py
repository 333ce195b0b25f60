"""A FastAPI route with a shorter way through for the requests a service answers most: FastAPI describes,
validates and refuses as the route declares, but a request it would accept is answered without its
per-request machinery.

By hand: FastAPI solves a route's dependencies, parses the body with the standard library's JSON reader
and validates the result, two exit stacks around it, for every request; at 32 searches in flight that
took about 0.1 ms of the event loop's 0.65 a request (docs/performance.md, "Fourth round"), the event
loop being the one thread every request passes. FastAPI has no switch for a leaner path.

The body's model is read from what FastAPI makes of the route (`dependant`, `body_field`: internals),
and the route's ASGI application (`app`) is swapped for `answer`. Where these are not as expected (a
FastAPI past the pyproject's bound), the route keeps FastAPI's handling for every request, said once in
the log (`_body_model`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import fastapi
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message, Receive, Scope, Send

from densekit.errors import InputError
from densekit.serving.checked_route import CheckedRoute

JSON_MEDIA_TYPE = "application/json"
log = logging.getLogger("densekit")
_fallback_said = False  # whether the log has said that the direct routes take FastAPI's way


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
        self.admits = admits
        self.standard = self.app  # FastAPI's handling, for everything not answered directly
        model = _body_model(self)
        if model is not None:
            self.model: type[BaseModel] = model
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


def _body_model(route: DirectRoute) -> type[BaseModel] | None:
    """The model of `route`'s body, as FastAPI describes the route; a route of other parameters is a
    ValueError. None where FastAPI's description is not as expected (the route then keeps FastAPI's
    handling), said once a process in the log."""
    try:
        dependant, body_field = route.dependant, route.body_field
        others = (dependant.path_params, dependant.query_params, dependant.header_params,
                  dependant.cookie_params)  # fmt: skip
        bodies = len(dependant.body_params)
        model = None if body_field is None else body_field.field_info.annotation
        usable = callable(route.app)
    except (AttributeError, TypeError) as err:
        problem: str | None = f"{type(err).__name__}: {err}"
    else:
        problem = None if usable else "a route's application is not callable"
    if problem is not None:
        _say_fallback(problem)
        return None
    if bodies != 1 or any(others) or body_field is None:
        raise InputError(f"{route.path}: a direct route's endpoint takes one body model and nothing else")
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise InputError(f"{route.path}: a direct route's body is a pydantic model, not {model!r}")
    return model


def _say_fallback(problem: str) -> None:
    """Log, once a process, that the direct routes answer FastAPI's way, and why."""
    global _fallback_said
    if _fallback_said:
        return
    _fallback_said = True
    log.warning("FastAPI %s's routes are not as densekit's direct routes read them (%s): /search and "
                "/v1/embeddings take FastAPI's way for every request (about 0.1 ms more of the event loop "
                "each: docs/performance.md); install the versions pyproject.toml allows",
                fastapi.__version__, problem)  # fmt: skip


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
