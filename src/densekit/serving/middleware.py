"""The service's ASGI middleware: the bound on a request's body, and the checks of its Host header."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from typing import Any

from fastapi import HTTPException
from starlette.datastructures import Headers

from densekit.serving.bearer import closing_if_body_unsent
from densekit.serving.checks import shown
from densekit.serving.error_answers import error_response

LOCAL_NAMES = ("localhost",)  # with any name under .localhost and any IP address, always allowed as Host
ANY_HOST = "*"


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413, whether or not it says its length."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            closing = closing_if_body_unsent(Headers(scope=scope))  # refused before the body was asked for
            await error_response(scope["path"], self.message, 413, closing or None)(scope, receive, send)
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


# A Host header's name (or bracketed IPv6 address) and port, as RFC 9110 allows it (its port, RFC 3986's,
# may be empty: `localhost:` is `localhost`); anything else (user info, a path, spaces) is no host of ours.
_HOST = re.compile(r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._~!$&'()*+,;=%-]+))(?::[0-9]{0,5})?")


class HostCheck:
    """ASGI middleware for the Host header: a request with more than one gets 400 (RFC 9112, 3.2: which
    one a proxy or a check would read is anyone's guess); and against DNS rebinding, where `allowed` is
    given, a request whose Host is not an IP address, not `localhost` (or a name under .localhost) and
    not one of `allowed` gets 403. A web page can point a name of its own at 127.0.0.1 and so reach a
    service on this machine, but its requests then carry that name as Host. starlette's
    TrustedHostMiddleware answers 400 without a reason and would need every address listed; a request
    without a Host header (HTTP/1.0) does not come from a browser and passes."""

    def __init__(self, app: Any, allowed: Sequence[str] | None):
        self.app = app
        names = None if allowed is None else (*LOCAL_NAMES, *allowed)
        self.allowed = None if names is None else {name.lower().rstrip(".") for name in names}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            hosts = [value for name, value in scope.get("headers") or [] if name == b"host"]
            if len(hosts) > 1:
                message = f"{len(hosts)} Host headers: a request carries one"
                await error_response(scope["path"], message, 400)(scope, receive, send)
                return
            given = hosts[0] if hosts else None
            if self.allowed is None or ANY_HOST in self.allowed or given is None:
                await self.app(scope, receive, send)
                return
            if not self.allows(given.decode("latin-1")):
                message = (f"Host {shown(given.decode('latin-1'))} is not an address of this service nor a "
                           "name it allows (a guard against DNS rebinding): start `densekit serve` with "
                           "--allowed-host NAME to allow a name")  # fmt: skip
                await error_response(scope["path"], message, 403)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def allows(self, header: str) -> bool:
        """Whether a request with this Host header may be answered."""
        found = _HOST.fullmatch(header.strip())
        if found is None:
            return False
        name = (found["ipv6"] or found["name"]).lower().rstrip(".")
        if name in self.allowed or name.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True  # an address is no name that DNS could rebind
