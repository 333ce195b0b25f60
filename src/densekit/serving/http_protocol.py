"""HTTP/1.1 for `densekit serve`: uvicorn's protocol over httptools (llhttp), with a bound on a request's
header section that uvicorn's lacks.

httptools parses a request for about 0.1 ms less of the event loop than h11 at 32 in flight
(docs/performance.md), and the event loop is the one thread every request passes. But uvicorn's
httptools protocol reads headers without end (it answered a request of 2 MB of them), where h11
refuses more than 16 KiB: this one refuses them past the same 16 KiB, as h11 does (400 and the
connection closed), by hand because neither uvicorn nor httptools has the setting.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# h11's default bound on the bytes of a request line and headers that have not all arrived, which
# uvicorn's h11 protocol applies
MAX_HEADER_BYTES = 16 * 1024
REFUSAL = "Invalid HTTP request received."  # uvicorn's words for a request h11 refuses


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a request whose line and headers, not yet ended, pass
    `MAX_HEADER_BYTES`, as h11 refuses them: with 400, the connection closed.

    As with h11, the bound holds while the header section is open: a section that arrives whole is
    parsed whatever its size (h11 too parses what it has in full). What is counted is the chunks read
    from the socket that began inside an open section and left it open; the chunk in which a request
    begins is not (its share of it is not known), so a header section that never ends is refused
    within one chunk's read (256 KiB in asyncio) past the bound, and a body that shares a chunk with
    its headers is never counted."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._in_headers = False
        self._unfinished_bytes = 0

    def data_received(self, data: bytes) -> None:
        """Parse `data`, then refuse the request if its header section is still open past the bound."""
        began_inside = self._in_headers
        super().data_received(data)
        if began_inside and self._in_headers and not self.transport.is_closing():
            self._unfinished_bytes += len(data)
            if self._unfinished_bytes > MAX_HEADER_BYTES:
                self.logger.warning(REFUSAL)
                self.send_400_response(REFUSAL)

    def on_message_begin(self) -> None:
        """A request begins: its header section is open and nothing of it is counted yet."""
        super().on_message_begin()
        self._in_headers = True
        self._unfinished_bytes = 0

    def on_headers_complete(self) -> None:
        """The header section ended: the request goes to the application."""
        self._in_headers = False
        super().on_headers_complete()
