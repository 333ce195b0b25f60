"""How `densekit serve` runs uvicorn: its settings (`server_config`) and its server (`Server`), with the
bounds on connections of `settings.ConnectionLimits`.

HTTP is parsed by `http_protocol.BoundedHttpToolsProtocol`, which subclasses uvicorn's httptools
protocol, an internal class: where that is not as expected (`http_protocol.unexpected_internals`,
checked once a process), uvicorn's h11 protocol parses instead, with one log line saying so and what
it keeps (`_h11_config`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket

import uvicorn

from densekit.serving.connections import ConnectionGuard
from densekit.serving.rate_limited_log import RateLimitedLog
from densekit.serving.settings import MAX_HEADER_BYTES, ConnectionLimits

log = logging.getLogger("densekit")
# Open files the service keeps besides its connections (the listening socket, the event loop's, the
# model's and the index's files, logs): what --max-connections leaves of the process's limit.
FILES_KEPT = 64
# asyncio's words for an accept that failed for want of open files or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM)
ACCEPT_FAILED = "socket.accept() out of system resource"
# and the name of what it schedules to try again a second later, once for every accept it tried
ACCEPT_RETRY = "._start_serving("


def server_config(
    app: object, host: str, port: int, limits: ConnectionLimits | None = None
) -> uvicorn.Config:
    """uvicorn's settings for serving `app`: requests in flight get 30 s to finish at shutdown, and HTTP
    is parsed by httptools with the bounds of `BoundedHttpToolsProtocol`: headers and trailers at 16 KiB
    as h11 bounds them (uvicorn's own httptools protocol read 2 MB of headers and answered), and the
    deadlines and connection cap of `limits` (`serve`'s defaults if None), the cap lowered to fit the
    process's open-file limit; by h11 where uvicorn's httptools protocol is not as expected."""
    limits = _within_open_files(limits or ConnectionLimits())
    if _bounded_protocol_unusable():
        return _h11_config(app, host, port, limits)
    from densekit.serving.http_protocol import BoundedHttpToolsProtocol

    protocol = BoundedHttpToolsProtocol.for_guard(ConnectionGuard(limits))
    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30,
                          http=protocol, timeout_keep_alive=limits.idle_timeout_s)  # fmt: skip


def _h11_config(app: object, host: str, port: int, limits: ConnectionLimits) -> uvicorn.Config:
    """uvicorn's h11 protocol with what its public settings keep of `limits`: h11 bounds a request's
    unfinished headers and trailers at 16 KiB (400) and answers pipelined requests; a connection is
    closed after `idle_timeout_s` without a request once it has had an answer (not before its first);
    past `max_connections` open (or requests under way), a request gets 503, its connection kept open.
    Lost: the deadlines for a request's headers and body, and the closing of the connection waiting
    longest past the cap."""
    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30,
                          http="h11", h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          timeout_keep_alive=limits.idle_timeout_s,
                          limit_concurrency=limits.max_connections)  # fmt: skip


@functools.cache
def _bounded_protocol_unusable() -> bool:
    """Whether uvicorn's httptools protocol is not as `BoundedHttpToolsProtocol` expects: checked once a
    process, and said once in the log with what h11 keeps and loses."""
    try:
        from densekit.serving.http_protocol import unexpected_internals

        problem = unexpected_internals()
    except ImportError as err:  # what it subclasses moved
        problem = f"uvicorn {uvicorn.__version__}'s httptools protocol cannot be imported ({err})"
    if problem is None:
        return False
    log.warning("%s: HTTP is parsed by uvicorn's h11 protocol instead, which bounds headers at 16 KiB and "
                "closes idle connections, but has no deadline for a request's headers or body and answers "
                "503 past --max-connections rather than closing the connection waiting longest; install "
                "the versions pyproject.toml allows", problem)  # fmt: skip
    return True


class Server(uvicorn.Server):
    """uvicorn's server, logging the connections it could not accept (out of open files, say) once an
    interval with a count: asyncio (3.11) logs each failed accept with its traceback, trying again as
    many times as the listen backlog (2,048) at once, and 1,100 stalled connections under a limit of
    1,024 open files wrote 34,505 records (29 MB) in 30 s."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve until told to stop, as uvicorn does."""
        _log_refused_accepts(asyncio.get_running_loop())
        await super().serve(sockets)


def _log_refused_accepts(loop: asyncio.AbstractEventLoop) -> None:
    """Have `loop` log its failed accepts through a `RateLimitedLog`, and the rest as it would."""
    refused = RateLimitedLog(
        log, "accepts of a connection that failed for want of open files or memory (raise `ulimit -n`, or "
        "lower --max-connections): %d"
    )  # fmt: skip
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = str(context.get("message", ""))
        if message == ACCEPT_FAILED:
            refused.note()
        elif ACCEPT_RETRY in message and isinstance(context.get("exception"), ValueError):
            # a retry of a failed accept come due once the listening socket was closed (its file
            # descriptor is -1): as many tracebacks at shutdown as accepts had failed in the last second
            pass
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


def _within_open_files(limits: ConnectionLimits) -> ConnectionLimits:
    """`limits` with `max_connections` lowered, and one line logged, where the process may not open as
    many files besides the ones it keeps (a connection is an open file)."""
    try:
        import resource
    except ImportError:  # not on Unix: the limit is the system's
        return limits
    allowed, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if allowed == resource.RLIM_INFINITY or limits.max_connections + FILES_KEPT <= allowed:
        return limits
    fitted = max(1, allowed - FILES_KEPT)
    log.warning("--max-connections %d lowered to %d: this process may open %d files (`ulimit -n`) and "
                "keeps about %d for itself", limits.max_connections, fitted, allowed, FILES_KEPT)  # fmt: skip
    return limits.model_copy(update={"max_connections": fitted})
