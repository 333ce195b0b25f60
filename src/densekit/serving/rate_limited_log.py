"""A log line for an event that an attack can repeat thousands of times a second (a connection refused,
a request cut off): the first is logged at once, the rest counted and logged as one line an interval."""

from __future__ import annotations

import asyncio
import logging

INTERVAL_S = 10.0


class RateLimitedLog:
    """Logs `message % count` (a warning on `logger`) for the first event, then at most once every
    `interval` seconds with the number of events since the last line; nothing while none happen. The
    message ends with its count (`"...: %d"`), which reads the same for one event as for many.

    Used from the event loop's thread only (protocol callbacks, the loop's exception handler): the
    counts are not locked, and the interval's line is a timer of the running loop."""

    def __init__(self, logger: logging.Logger, message: str, interval: float = INTERVAL_S):
        self.logger, self.message, self.interval = logger, message, interval
        self.unlogged = 0
        self._timer: asyncio.TimerHandle | None = None

    def note(self, count: int = 1) -> None:
        """Count `count` events: logged now if no line was written within the interval, else at its end."""
        self.unlogged += count
        if self._timer is None:
            self._flush()

    def _flush(self) -> None:
        self._timer = None
        if self.unlogged == 0:
            return
        self.logger.warning(self.message, self.unlogged)
        self.unlogged = 0
        self._timer = asyncio.get_running_loop().call_later(self.interval, self._flush)
