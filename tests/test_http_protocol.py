"""`serve`'s HTTP parsing (`serving.http_protocol`): httptools with the request line and headers bounded as
h11 bounds them. Each raw exchange gets the answers uvicorn's h11 protocol gives it, from a real
server over a socket; without the bound, httptools answers the floods that h11 refuses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from densekit.serving import http_protocol, http_server
from densekit.serving.app import create_app
from densekit.serving.http_server import server_config

from .service_fixtures import AUTH, TOKEN, free_port, in_thread, running


async def _lifespan(receive, send) -> None:
    """An ASGI application's part in the server's start and end."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def body_length(scope: dict, receive, send) -> None:
    """An ASGI application answering each request with the length of its body."""
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    answer = str(len(body)).encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


@contextlib.contextmanager
def serving(http: str) -> Iterator[int]:
    """`body_length` served by uvicorn as `serve` configures it ("ours") or with its h11 protocol."""
    config = server_config(body_length, "127.0.0.1", free_port())
    if http == "h11":
        config = uvicorn.Config(
            body_length, host="127.0.0.1", port=config.port, http="h11", log_level="warning"
        )
    with running(config):
        yield config.port


def exchange(port: int, request: bytes) -> list[str]:
    """Send `request` on one connection and read until the server closes it: the status of each answer
    and its body, or "closed" where the server cut the connection without an answer."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        with contextlib.suppress(ConnectionError):
            connection.sendall(request)
        with contextlib.suppress(ConnectionError):
            while chunk := connection.recv(65536):
                received += chunk
    answers = re.findall(rb"HTTP/1.1 (\d{3}) .*?\r\n\r\n(\d*)", received, flags=re.S)
    return [f"{status.decode()} {body.decode()}".strip() for status, body in answers] or ["closed"]


def get(target: str = "/", headers: dict[str, str] | None = None, close: bool = True) -> bytes:
    lines = [f"GET {target} HTTP/1.1", "Host: localhost", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines + (["Connection: close"] if close else [])) + "\r\n\r\n").encode()


def headers_of(total: int) -> dict[str, str]:
    """Headers of about `total` bytes as written, in lines of 1,000."""
    return {f"x-filler-{n}": "y" * 985 for n in range(total // 1000)}


# Each exchange is answered alike however the kernel cuts it into reads: what is refused is far past
# the bound (h11 refuses only a header section still open past 16 KiB, so one that arrives whole
# within a read is parsed whatever its size), what is answered far within it.
EXCHANGES = {
    "a plain request": get(),
    "15 KB of headers": get(headers=headers_of(15_000)),
    "2 MB of headers": get(headers=headers_of(2_000_000)),
    "one header of 600 KB": get(headers={"x-long": "y" * 600_000}),
    "a 600 KB target": get("/" + "a" * 600_000),
    "a 300 KB body sent with its headers": b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 300000\r\n"
    b"Connection: close\r\n\r\n" + b"z" * 300_000,
    "15 KB of headers twice on one connection": get(headers=headers_of(15_000), close=False)
    + get(headers=headers_of(15_000)),
}


@pytest.fixture(scope="module")
def h11_answers() -> dict[str, list[str]]:
    with serving("h11") as port:
        return {name: exchange(port, request) for name, request in EXCHANGES.items()}


def test_every_exchange_gets_the_answers_h11_gives(h11_answers: dict[str, list[str]]):
    with serving("ours") as port:
        ours = {name: exchange(port, request) for name, request in EXCHANGES.items()}
    assert ours == h11_answers
    # what h11 gives, so that the comparison means something: floods refused, the rest answered
    assert h11_answers["15 KB of headers"] == ["200 0"]
    assert h11_answers["15 KB of headers twice on one connection"] == ["200 0", "200 0"]
    assert h11_answers["a 300 KB body sent with its headers"] == ["200 300000"]
    for flood in ("2 MB of headers", "one header of 600 KB", "a 600 KB target"):
        assert h11_answers[flood] in (["400"], ["closed"]), flood


def test_without_the_bound_httptools_answers_a_flood(monkeypatch):
    monkeypatch.setattr(http_protocol, "MAX_HEADER_BYTES", 1 << 30)
    with serving("ours") as port:
        assert exchange(port, EXCHANGES["2 MB of headers"]) == ["200 0"]


@pytest.fixture
def changed_uvicorn(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """uvicorn's httptools protocol without a method densekit's overrides, as a later uvicorn might have
    it: the check of its internals made afresh, and again after."""
    monkeypatch.delattr(HttpToolsProtocol, "on_response_complete")
    http_server._bounded_protocol_unusable.cache_clear()
    yield
    http_server._bounded_protocol_unusable.cache_clear()


def test_where_uvicorns_protocol_is_not_as_read_h11_parses_and_the_log_says_so_once(
    changed_uvicorn: None, h11_answers: dict[str, list[str]], retriever, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.WARNING, logger="densekit"):
        configs = [server_config(body_length, "127.0.0.1", free_port()) for _ in range(2)]
    said = [record.getMessage() for record in caplog.records if "h11" in record.getMessage()]
    assert len(said) == 1 and "on_response_complete" in said[0], said
    assert [config.http for config in configs] == ["h11", "h11"]
    assert configs[0].h11_max_incomplete_event_size == http_protocol.MAX_HEADER_BYTES
    with running(configs[0]):
        answers = {name: exchange(configs[0].port, request) for name, request in EXCHANGES.items()}
    assert answers == h11_answers  # floods of headers refused as h11 refuses them
    with in_thread(create_app(retriever, TOKEN)) as url:  # the service, as `serve` runs it now
        found = httpx.post(f"{url}/search", json={"query": "cats", "k": 3}, headers=AUTH, timeout=30)
    assert found.status_code == 200
    assert [hit["id"] for hit in found.json()["results"][0]] == [
        hit.id for hit in retriever.search("cats", k=3)[0]
    ]


def test_a_refused_request_closes_its_connection_only_once_the_answers_before_it_and_its_own_have_gone():
    """A socket closed with bytes of the client's still unread is reset by the kernel, and a reset drops
    what it had not yet delivered. The client reads nothing for a while, so that when the flood after its
    pipelined requests is refused, their answers still wait to go."""
    pipelined = get(close=False) * 2000 + get(headers=headers_of(2_000_000))
    with serving("ours") as port, socket.socket() as connection:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        connection.connect(("127.0.0.1", port))
        sending = threading.Thread(target=_send_all, args=(connection, pipelined))
        sending.start()
        time.sleep(1)  # answers pile up on the server's side of the connection
        received = b""
        with contextlib.suppress(ConnectionError):
            connection.settimeout(10)
            while chunk := connection.recv(65536):
                received += chunk
        sending.join()
    answers = [status.decode() for status in re.findall(rb"HTTP/1.1 (\d{3}) ", received)]
    assert answers == ["200"] * 2000 + ["400"]


def _send_all(connection: socket.socket, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        connection.sendall(data)


def test_a_refused_client_that_keeps_sending_is_cut_off_after_the_linger(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(http_protocol, "LINGER_S", 0.5)
    with serving("ours") as port, socket.create_connection(("127.0.0.1", port)) as connection:
        endless = threading.Thread(target=_send_headers_without_end, args=(connection,))
        endless.start()
        received = b""
        connection.settimeout(20)
        while chunk := connection.recv(65536):  # to the end the server's side wrote
            received += chunk
        endless.join(timeout=15)  # the sending ends when the server closes the connection
        cut_off = not endless.is_alive()
        with contextlib.suppress(OSError):
            connection.shutdown(socket.SHUT_RDWR)  # where the server did not, the test stops it
        endless.join()
    assert re.findall(rb"HTTP/1.1 (\d{3}) ", received) == [b"400"] and cut_off


def _send_headers_without_end(connection: socket.socket) -> None:
    line = b"x-filler: " + b"y" * 990 + b"\r\n"
    with contextlib.suppress(OSError):
        connection.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n")
        while True:
            connection.sendall(line * 64)


async def answers_late(scope: dict, receive, send) -> None:
    """An ASGI application answering each request half a second after it came, its body unread."""
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    await asyncio.sleep(0.5)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_an_application_answering_a_request_refused_while_the_connection_lingers_fails_nothing():
    """Trailers past the bound refuse a request whose application answers later, while the refused
    connection lingers: its answer is dropped, as at a close, and nothing fails."""
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # type: ignore[method-assign]
    config = server_config(answers_late, "127.0.0.1", free_port())
    logging.getLogger("uvicorn.error").addHandler(handler)  # after the config has set uvicorn's logging
    flood = b"POST / HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nz\r\n0\r\n"
    flood += b"".join(f"x-trailer-{n}: {'y' * 985}\r\n".encode() for n in range(2000))
    try:
        with running(config), socket.create_connection(("127.0.0.1", config.port)) as connection:
            connection.sendall(flood)
            connection.settimeout(10)
            received = b""
            while chunk := connection.recv(65536):  # to the end of what the server writes
                received += chunk
            time.sleep(1)  # the connection still open, the application answers meanwhile
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert re.findall(rb"HTTP/1.1 (\d{3}) ", received) == [b"400"]
    assert [record.getMessage() for record in errors] == []
