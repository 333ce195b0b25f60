"""The service's bearer token: the one check of it, made on every request that needs it before anything
reads the request's body (`checked_route.CheckedRoute`)."""

from __future__ import annotations

import hmac

from fastapi import HTTPException
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.requests import Request

REFUSED = "missing or wrong bearer token"


class BearerToken:
    """A service's token (`api_key`; None: none is asked). A request carries it as `Authorization:
    Bearer <token>`, the scheme in any case, as FastAPI's `HTTPBearer` reads it; compared in constant time."""

    def __init__(self, api_key: str | None):
        self.api_key = api_key
        self._as_written = None if api_key is None else f"Bearer {api_key}".encode()

    def as_written(self, request: Request) -> bool:
        """Whether `request` carries `Authorization: Bearer <token>` exactly so (or no token is asked):
        what the direct routes answer themselves; `check` decides on every other form."""
        if self._as_written is None:
            return True
        given = request.headers.get("authorization")
        return given is not None and hmac.compare_digest(given.encode("latin-1"), self._as_written)

    def check(self, request: Request) -> None:
        """Refuse `request` with 401 unless it carries the token. A client that waits for `100 Continue`
        before sending its body is told the connection closes: it has sent no body, and gets no
        `100 Continue` (uvicorn sends one only when the body is first read)."""
        if self.as_written(request):
            return
        scheme, given = get_authorization_scheme_param(request.headers.get("authorization"))
        key = str(self.api_key)
        if scheme.lower() == "bearer" and given and hmac.compare_digest(given.encode(), key.encode()):
            return
        headers = {"WWW-Authenticate": "Bearer", **closing_if_body_unsent(request.headers)}
        raise HTTPException(401, REFUSED, headers=headers)


def closing_if_body_unsent(headers: Headers) -> dict[str, str]:
    """`Connection: close` for an answer to a request of `headers` given before its body was asked for
    with `100 Continue`: the client has sent none, so the connection cannot be read on (RFC 9110, 10.1.1)."""
    expects = headers.get("expect", "").lower() == "100-continue"
    return {"Connection": "close"} if expects else {}
