"""A FastAPI route whose requests pass a check before anything reads their body: the bearer token, so that
a request without it is refused before its body is read, parsed or asked for (`Expect: 100-continue`).

FastAPI reads and parses a route's body before it solves the route's dependencies, so a check made as a
dependency comes after the body. Overriding `get_route_handler` is FastAPI's documented way to run code
around a route's handling ("Custom Request and APIRoute class")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response


class CheckedRoute(APIRoute):
    """An `APIRoute` whose every request is first given to `check`, which raises (an `HTTPException`,
    say) to refuse it; nothing of the request's body has been read then."""

    def __init__(self, path: str, endpoint: Callable[..., Any], *,
                 check: Callable[[Request], None] | None = None, **kwargs: Any) -> None:  # fmt: skip
        self.check = check  # before the base class builds the handler
        super().__init__(path, endpoint, **kwargs)

    def get_route_handler(self) -> Callable[[Request], Any]:
        """FastAPI's handler of this route, after `check`."""
        handler = super().get_route_handler()
        check = self.check
        if check is None:
            return handler

        async def checked(request: Request) -> Response:
            check(request)
            return await handler(request)

        return checked
