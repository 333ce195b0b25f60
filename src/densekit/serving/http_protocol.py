"""HTTP/1.1 for `densekit serve`: uvicorn's protocol over httptools (llhttp), with the bounds uvicorn's
lacks: on the bytes of a request's header and trailer sections, on the time its headers, its body and an
idle connection may take, and on the connections open (`ConnectionGuard`).

httptools parses a request for about 0.1 ms less of the event loop than h11 at 32 in flight
(docs/performance.md), and the event loop is the one thread every request passes. But uvicorn's
httptools protocol reads headers and a chunked body's trailers without end (it answered a request of 2 MB
of headers, and held 200 MB of trailers), where h11 refuses more than 16 KiB of either: this one refuses
them past the same 16 KiB, as h11 does (400 and the connection closed). Neither uvicorn nor httptools has
these settings, so they are written here, over uvicorn's protocol class (an internal one:
`http_server.server_config` checks that it is as expected and falls back to uvicorn's h11 protocol if not).
"""

from __future__ import annotations

import asyncio
import inspect
from http import HTTPStatus
from typing import Any, Literal

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from densekit.serving.connections import ConnectionGuard
from densekit.serving.settings import MAX_HEADER_BYTES

REFUSAL = "Invalid HTTP request received."  # uvicorn's words for a request h11 refuses
TOO_SLOW = "Request Timeout: the request did not arrive in time."
TOO_MANY = "Service Unavailable: too many connections, each with a request under way."
# What of uvicorn's httptools protocol (an internal class) this one overrides, calls or reads: checked
# before it is used (`unexpected_internals`)
METHODS = ("connection_made", "connection_lost", "data_received", "on_message_begin", "on_headers_complete",
           "on_body", "on_message_complete", "on_response_complete", "handle_websocket_upgrade")  # fmt: skip
ARGUMENTS = ("config", "server_state", "app_state", "_loop")
ATTRIBUTES = ("loop", "transport", "flow", "cycle", "pipeline", "parser")

Deadline = Literal["headers", "body", "idle"]
# How long a refused connection is read and its bytes dropped, at most, before it is closed (`_linger`)
LINGER_S = 2.0


def unexpected_internals() -> str | None:
    """What of uvicorn's httptools protocol is not as `BoundedHttpToolsProtocol` uses it (a method, an
    argument, an attribute of a connection's protocol), or None. The pyproject's bounds keep uvicorn and
    httptools at versions where it is; this catches a version past them."""
    missing = [name for name in METHODS if not callable(getattr(HttpToolsProtocol, name, None))]
    arguments = inspect.signature(HttpToolsProtocol.__init__).parameters
    missing += [f"argument {name}" for name in ARGUMENTS if name not in arguments]
    if not missing:
        loop = asyncio.new_event_loop()
        try:  # one made as the server makes each, to see the attributes it sets
            config = uvicorn.Config(_no_app, log_config=None)
            protocol = HttpToolsProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
            missing += [f"attribute {name}" for name in ATTRIBUTES if not hasattr(protocol, name)]
        except Exception as err:  # any failure to make one is the answer
            missing.append(f"a protocol could not be made ({type(err).__name__}: {err})")
        finally:
            loop.close()
    if not missing:
        return None
    return (
        f"uvicorn {uvicorn.__version__}'s httptools protocol lacks what densekit's uses: {', '.join(missing)}"
    )


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    """The application of the protocol `unexpected_internals` makes, which is never called."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounds, each answered as h11 answers a request over its bound
    (400, or 408 for a deadline, and the connection closed):

    - a request's line and headers, or a chunked body's trailers, not yet ended past `MAX_HEADER_BYTES`.
      As with h11, the bound holds while a section is open: a section that arrives whole is parsed
      whatever its size (h11 too parses what it has in full). What is counted is the reads from the
      socket that began inside an open section and left the same one open (no request began in them,
      no body came); the read in which a section begins is not (its share of it is not known), so a
      section that never ends is refused within one read (256 KiB in asyncio) past the bound, and
      pipelined requests, each beginning in a read, are never counted against each other;
    - the deadlines of `guard.limits`: headers from a request's first byte, its body from its headers,
      and an idle connection (no request under way, nothing of a new one come) from when it became so.
      The client is not held to a deadline while the service answers an earlier request of its;
    - the connections open, held to the cap by `guard` (`ConnectionGuard.admit`).

    `guard` is one server's, set on a subclass made for it (`for_guard`)."""

    guard: ConnectionGuard

    @classmethod
    def for_guard(cls, guard: ConnectionGuard) -> type[BoundedHttpToolsProtocol]:
        """This protocol for a server whose connections `guard` holds."""
        return type(cls.__name__, (cls,), {"guard": guard})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section: Literal["headers", "trailers"] | None = None  # open and counted
        self.section_bytes = 0
        self.in_body = False  # between a request's headers and its end
        self.waiting_since: float | None = None  # since when no request has been under way
        self._began = False  # a request began in the read being parsed
        self._body_came = False  # body bytes came in the read being parsed
        self._deadline: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None  # due once earlier requests are answered
        self._lingering = False  # refused: what comes is dropped until the connection closes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Count the connection in (closing another past the cap), and give it the idle deadline."""
        super().connection_made(transport)
        self.waiting_since = self.loop.time()
        if not self.guard.admit(self):
            self._refuse(503, TOO_MANY, linger=False)  # nothing read yet, and no time to spare one
            return
        self._arm("idle")

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection closed: no deadline left, and counted out."""
        self._disarm()
        self.guard.forget(self)
        super().connection_lost(exc)

    def make_way(self) -> None:
        """Close this connection, which waits for a request, for a new one past the cap."""
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        """Parse `data`, then refuse the request if a section open before it is still open, past the bound
        (once refused, what comes is dropped unread)."""
        if self._refusal is not None or self._lingering:
            return
        section, self._began, self._body_came = self.section, False, False
        super().data_received(data)
        if section is None or self.section != section or self._began or self._body_came:
            return
        self.section_bytes += len(data)
        if self.section_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self.guard.malformed.note()
            self._refuse(400, REFUSAL)

    def on_message_begin(self) -> None:
        """A request begins: its header section is open, nothing of it counted yet, its deadline set."""
        super().on_message_begin()
        self._began = True
        self.section, self.section_bytes = "headers", 0
        self._arm("headers")

    def on_headers_complete(self) -> None:
        """The header section ended: the request goes to the application, and its body is due."""
        self.section, self.in_body, self.waiting_since = None, True, None
        self._arm("body")
        super().on_headers_complete()

    def on_chunk_header(self) -> None:
        """A chunk's size line ended: its data follows, or, after the last, the trailer section."""
        self.section, self.section_bytes = "trailers", 0

    def on_body(self, body: bytes) -> None:
        """Body bytes: no section is open."""
        self.section, self._body_came = None, True
        super().on_body(body)

    def on_chunk_complete(self) -> None:
        """A chunk (or the trailer section) ended."""
        self.section = None

    def on_message_complete(self) -> None:
        """The request has all arrived: the service's turn, or if it has answered already, idle."""
        self.section, self.in_body = None, False
        if self.cycle is not None and self.cycle.response_complete:
            self._arm("idle")
        else:
            self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """An answer went: a refusal that waited for it is made; else, with no other request under way,
        the connection waits (idle until one begins)."""
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self._refusal is not None:
            self._refuse(*self._refusal)
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return
        self.waiting_since = self.loop.time()
        if self.section is None and not self.in_body:
            self._arm("idle")

    def handle_websocket_upgrade(self) -> None:
        """The connection goes to uvicorn's WebSocket protocol: no longer this one's to bound."""
        self._disarm()
        self.guard.forget(self)
        super().handle_websocket_upgrade()

    def _arm(self, deadline: Deadline) -> None:
        """Close the connection if nothing ends `deadline` first (another armed is replaced)."""
        self._disarm()
        limits = self.guard.limits
        seconds = {"headers": limits.header_timeout_s, "body": limits.body_timeout_s,
                   "idle": limits.idle_timeout_s}[deadline]  # fmt: skip
        self._deadline = self.loop.call_later(seconds, self._expired, deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, deadline: Deadline) -> None:
        """`deadline` passed: close the connection (idle) or refuse its request with 408, unless the
        client is waiting for an answer to an earlier request of its, when the deadline starts again."""
        self._deadline = None
        if self.transport.is_closing():
            return
        if deadline == "idle":
            self.transport.close()
        elif self._behind_another():
            self._arm(deadline)
        else:
            self.guard.too_slow.note()
            self._refuse(408, TOO_SLOW)

    def _behind_another(self) -> bool:
        """Whether the request arriving waits behind an earlier one of the connection still being answered."""
        if self.in_body:  # the request arriving has a cycle: queued if another is answered first
            return any(cycle is self.cycle for cycle, _ in self.pipeline)
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, status: int, reason: str, linger: bool = True) -> None:
        """Answer the request arriving with `status` and `reason` and close the connection, as soon as the
        answers to earlier requests of the connection have gone (nothing more is read meanwhile); where
        the request's own answer has begun (a 401 given before its body ended), close it only. With
        `linger`, a connection that had the refusal written closes as `_linger` closes it."""
        if self.in_body:  # the request arriving has a cycle
            waits = self._behind_another()
            answered = self.cycle.response_started
        else:
            waits, answered = self.cycle is not None and not self.cycle.response_complete, False
        if waits:
            self._refusal = (status, reason)
            self.flow.pause_reading()
            return
        if not answered:
            body = reason.encode("ascii")
            head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
                    f"content-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
                    "connection: close\r\n\r\n")  # fmt: skip
            self.transport.write(head.encode("ascii") + body)
        if linger and not answered and self.transport.can_write_eof():
            self._linger()
        else:
            self.transport.close()

    def _linger(self) -> None:
        """Close the connection once the client has had all that was written to it: the writing side
        ends after the last answer (the client reads to its end), and what the client still sends is
        read and dropped until it closes its side, or for `LINGER_S` at most. Closing a socket with
        bytes unread makes the kernel reset the connection, and a reset drops the answers not yet
        delivered: the answers to pipelined requests before a refused one, and the refusal itself.
        asyncio closes only after its own buffer, uvicorn has no such close, so it is written here."""
        self._disarm()
        self._refusal, self._lingering = None, True
        if self.cycle is not None and not self.cycle.response_complete:
            # the refused request's application sees the connection gone now, as uvicorn tells it at
            # the close: its sends are dropped (a write after the writing side ended would raise)
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.waiting_since = 0.0  # the first to make way for a new connection past the cap
        self.transport.write_eof()
        self.flow.resume_reading()
        self._deadline = self.loop.call_later(LINGER_S, self.transport.close)
