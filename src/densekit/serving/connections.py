"""How long a client's connection may keep the service waiting, and how many it may hold open: the bounds
that keep slow or stalled connections (slowloris) from making the service unreachable."""

from __future__ import annotations

import logging
from typing import Protocol

from densekit.serving.rate_limited_log import RateLimitedLog
from densekit.serving.settings import ConnectionLimits

log = logging.getLogger("densekit")


class Guarded(Protocol):
    """A connection as `ConnectionGuard` sees it."""

    waiting_since: float | None  # since when it has had no request under way (None: it has one)

    def make_way(self) -> None:
        """Close the connection, to make way for a new one."""


class ConnectionGuard:
    """The open connections of one server, held to `limits.max_connections`, and the log lines of what
    it and the connections' deadlines refused (a line an interval, with a count)."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.open: set[Guarded] = set()
        most, header_s, body_s = limits.max_connections, limits.header_timeout_s, limits.body_timeout_s
        self.made_way = RateLimitedLog(
            log, f"connections closed while they waited for a request, to make way for new ones past "
            f"--max-connections {most}: %d"
        )  # fmt: skip
        self.refused = RateLimitedLog(
            log, f"connections refused, {most} being open (--max-connections) with a request under way on "
            "each: %d"
        )  # fmt: skip
        self.too_slow = RateLimitedLog(
            log, f"requests cut off with 408 for not arriving in time (--header-timeout {header_s:g} s, "
            f"--body-timeout {body_s:g} s): %d"
        )  # fmt: skip
        self.malformed = RateLimitedLog(
            log, "requests refused with 400 for a header or trailer section over 16 KiB: %d"
        )  # fmt: skip

    def admit(self, connection: Guarded) -> bool:
        """Count a new connection in, closing the one that has waited longest for a request if the cap is
        reached; False (the new one is to be refused) when every open one has a request under way."""
        if len(self.open) >= self.limits.max_connections:
            waiting = [c for c in self.open if c.waiting_since is not None]
            if not waiting:
                self.refused.note()
                return False
            oldest = min(waiting, key=lambda c: c.waiting_since or 0.0)
            self.open.discard(oldest)
            oldest.make_way()
            self.made_way.note()
        self.open.add(connection)
        return True

    def forget(self, connection: Guarded) -> None:
        """A connection closed."""
        self.open.discard(connection)
