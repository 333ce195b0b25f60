"""Issue 63's cases on the HTTP edge, in the issue's order: 1 (chunked trailers), 2 (slowloris), 3 (bodies
read before the 401), 5 (answers of megabytes), 18 (pipelined requests), 22 (a blank token variable), 26
(the client's settings) and 27 (strings as numbers, two Host headers, an empty port). Each is sent as a
client would, over a socket to a server started as `densekit serve` starts it where the HTTP layer is
what is tested."""

from __future__ import annotations

import contextlib
import json
import math
import re
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from densekit.client import Client, ServiceError
from densekit.errors import DensekitError
from densekit.retrieval.retriever import Retriever
from densekit.serving.app import create_app
from densekit.serving.direct_route import DirectRoute

from ..service_fixtures import AUTH, TOKEN, client, in_thread, serve_process
from ..test_http_protocol import exchange, get, serving
from ..test_outputs import cli

HEADERS_END = b"\r\n\r\n"


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _read_until_closed(connection: socket.socket, within: float) -> tuple[bytes, bool]:
    """What the server sends on `connection` until it closes it or `within` seconds pass: the bytes,
    and whether it closed."""
    connection.settimeout(0.05)
    received, deadline = b"", time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            chunk = connection.recv(65536)
        except TimeoutError:
            continue
        except ConnectionError:
            return received, True
        if not chunk:
            return received, True
        received += chunk
    return received, False


def _warnings(log: str) -> list[str]:
    """The warnings `densekit serve` logged, each on one line however its console wrapped it."""
    return [" ".join(record.split()) for record in re.findall(r"WARNING +(.*?)(?=\n\S|\Z)", log, flags=re.S)]


def _statuses(received: bytes) -> list[str]:
    return [status.decode() for status in re.findall(rb"HTTP/1.1 (\d{3}) ", received)]


@pytest.fixture(scope="module")
def service(retriever: Retriever) -> Iterator[str]:
    """The service with the test token under uvicorn as `serve` runs it (default connection limits)."""
    with in_thread(create_app(retriever, TOKEN)) as url:
        yield url


# 1: a chunked body's trailer section was read without end, and without the token being asked


def test_trailers_past_the_bound_close_the_connection_before_the_body_is_whole(service: str):
    start = (b"POST /search HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"q\":\r\n0\r\n")  # fmt: skip
    trailer = b"X-T: " + b"a" * 995 + b"\r\n"
    with socket.create_connection(_address(service)) as connection:
        connection.sendall(start)
        sent = 0
        with contextlib.suppress(ConnectionError):
            while sent < 4_000_000:  # never ended: a server reading them all would wait for more
                connection.sendall(trailer * 100)
                sent += len(trailer) * 100
        received, closed = _read_until_closed(connection, within=5)
    assert closed, f"{sent} bytes of trailers were read and the connection kept open"
    assert sent < 4_000_000 or _statuses(received)[-1:] in (["400"], ["401"])
    assert "200" not in _statuses(received)


def test_trailers_are_bounded_as_h11_bounds_them():
    body = (b"POST / HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            b"5\r\nhello\r\n0\r\n")  # fmt: skip

    def trailers(total: int) -> bytes:
        return b"".join(b"X-T%d: %s\r\n" % (n, b"a" * 985) for n in range(total // 1000)) + b"\r\n"

    answers = {}
    for http in ("h11", "ours"):
        with serving(http) as port:
            answers[http] = [exchange(port, body + trailers(n)) for n in (15_000, 2_000_000)]
    assert answers["ours"][0] == answers["h11"][0] == ["200 5"]  # 15 KB of them read, as h11 reads them
    assert [answer.split()[0] for answer in answers["h11"][1]] in (["400"], ["closed"])  # 2 MB: refused
    assert answers["ours"][1] in (["400"], ["closed"])


# 2: slowloris: no deadline for a request's headers or body, an idle connection or new connections


@pytest.fixture(scope="module")
def hurried(retriever: Retriever) -> Iterator[str]:
    """The service with half-second deadlines for headers, bodies and idle connections."""
    from densekit.serving.http_server import ConnectionLimits

    limits = ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.5, idle_timeout_s=0.5)
    with in_thread(create_app(retriever, TOKEN), limits) as url:
        yield url


def _held(url: str, sending: list[bytes], pause: float = 0.0, within: float = 4.0
          ) -> tuple[list[str], bool, float]:  # fmt: skip
    """Send `sending` on one connection, `pause` seconds apart, then read until the server closes it:
    the statuses answered, whether it closed, and after how many seconds."""
    started = time.monotonic()
    with socket.create_connection(_address(url)) as connection:
        with contextlib.suppress(ConnectionError):
            for piece in sending:
                connection.sendall(piece)
                time.sleep(pause)
        received, closed = _read_until_closed(connection, within)
    return _statuses(received), closed, time.monotonic() - started


def test_unfinished_requests_and_idle_connections_are_closed_at_their_deadlines(hurried: str):
    head = b"GET /health HTTP/1.1\r\nHost: localhost\r\n"
    body_start = (b"POST /search HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + TOKEN.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                  + b'{"query"')  # fmt: skip
    cases = {
        "headers that never end": ([head], 0.0),
        "headers a byte at a time": ([head] + [b"x"] * 40, 0.1),  # each byte within any idle timeout
        "a body that stops": ([body_start], 0.0),
        "nothing at all": ([], 0.0),
        "empty lines a byte at a time": ([b"\r\n"] * 40, 0.1),
        "a request answered, then nothing": ([b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"], 0.0),
    }
    results: dict[str, tuple[list[str], bool, float]] = {}

    def hold(name: str) -> None:
        results[name] = _held(hurried, *cases[name])

    threads = [threading.Thread(target=hold, args=(name,)) for name in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, (_, closed, took) in results.items():
        assert closed and took < 3.5, (name, results[name])
    assert results["headers that never end"][0] == ["408"]
    assert results["headers a byte at a time"][0] == ["408"]
    assert results["a body that stops"][0] == ["408"]
    assert results["nothing at all"][0] == [] and results["empty lines a byte at a time"][0] == []
    assert results["a request answered, then nothing"][0] == ["200"]
    assert httpx.get(f"{hurried}/health", timeout=5).status_code == 200


def test_past_the_connection_cap_the_longest_waiting_connections_are_closed(retriever: Retriever):
    from densekit.serving.http_server import ConnectionLimits

    limits = ConnectionLimits(max_connections=20, header_timeout_s=60, idle_timeout_s=60)
    with in_thread(create_app(retriever, TOKEN), limits) as url:
        stalled = [socket.create_connection(_address(url)) for _ in range(60)]
        try:
            for connection in stalled:
                connection.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # never finished
            started = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            assert time.monotonic() - started < 2
            closed = sum(_read_until_closed(connection, 0.05)[1] for connection in stalled)
        finally:
            for connection in stalled:
                connection.close()
    assert closed >= 40, closed  # the oldest unfinished ones made way; 20 at most were kept


def _open_files_limit(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return apply


def test_stalled_connections_past_the_open_file_limit_leave_serve_answering_its_log_short(served, tmp_path):
    # issue 63: 1,100 stalled connections under a limit of 1,024 open files made the service unreachable
    # and wrote 34,505 log records in 30 s
    process, url = serve_process(served, tmp_path, preexec_fn=_open_files_limit(256))
    stalled: list[socket.socket] = []
    try:
        stalled += [socket.create_connection(_address(url)) for _ in range(400)]
        for connection in stalled:
            with contextlib.suppress(ConnectionError):
                connection.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # its connection made way
        # then no open file left to accept with, for seconds: asyncio tries again and again
        in_use = len(list(Path(f"/proc/{process.pid}/fd").iterdir()))
        resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (in_use, in_use))
        stalled += [socket.create_connection(_address(url)) for _ in range(100)]
        time.sleep(2.5)
    finally:
        for connection in stalled:
            connection.close()
        process.terminate()
        log = process.communicate(timeout=60)[0]
    records = _warnings(log)
    assert "Traceback" not in log and 3 <= len(records) <= 5, log[-3000:]  # a line a kind, an interval
    assert records[0].startswith("--max-connections 1000 lowered to 192: this process may open 256 files")
    made_way = re.compile(r"to make way for new ones past --max-connections 192: \d+$")
    assert any(made_way.search(record) for record in records), records
    refused = [record for record in records if "for want of open files" in record]
    assert refused and all(re.search(r"--max-connections\): \d+$", record) for record in refused), records


# 3: an unauthenticated body was read and parsed before the 401, and got `100 Continue`


def _asgi_post(app, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[list[int], int]:
    """POST to `app` directly: the statuses it sends and how many times it read the request's body."""
    import asyncio

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"host", b"127.0.0.1"), *headers], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80), "app": app}  # fmt: skip
    statuses: list[int] = []
    reads = 0

    async def receive() -> dict:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b'{"query": "cats", "input": "cats", "model": "x"}',
                "more_body": False}  # fmt: skip

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    asyncio.run(app(scope, receive, send))
    return statuses, reads


@pytest.mark.parametrize("path", ["/search", "/v1/embeddings"])
@pytest.mark.parametrize("way", ["direct", "fastapi"])
def test_an_unauthenticated_body_is_not_read(retriever: Retriever, path: str, way: str):
    app = create_app(retriever, TOKEN)
    if way == "fastapi":
        for route in app.routes:
            if isinstance(route, DirectRoute):
                route.app = route.standard  # FastAPI's handling for every request
    with TestClient(app):  # started
        json_type = (b"content-type", b"application/json")
        for authorization in ([], [(b"authorization", b"Bearer wrong")], [(b"authorization", b"bearer x")]):
            sent = [json_type, (b"content-length", b"48"), *authorization]
            assert _asgi_post(app, path, sent) == ([401], 0)
        statuses, reads = _asgi_post(app, path, [json_type, (b"authorization", f"Bearer {TOKEN}".encode())])
    assert reads == 1 and statuses != [401]


def test_expect_100_continue_is_answered_only_with_the_token(service: str):
    def expecting(token: str | None) -> tuple[bytes, bytes]:
        authorization = f"Authorization: Bearer {token}\r\n" if token else ""
        request = ("POST /search HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                   f"{authorization}Content-Length: 17\r\nExpect: 100-continue\r\n\r\n").encode()  # fmt: skip
        with socket.create_connection(_address(service)) as connection:
            connection.sendall(request)
            connection.settimeout(5)
            first = connection.recv(65536)
            if b"100 Continue" in first:
                connection.sendall(b'{"query": "cats"}')
            rest, _ = _read_until_closed(connection, within=1)
        return first, rest

    first, rest = expecting(None)
    assert first.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in first + rest
    assert b"connection: close" in first.lower()  # the client never sent the body: nothing else to read
    first, rest = expecting(TOKEN)
    assert first.startswith(b"HTTP/1.1 100 Continue") and b"HTTP/1.1 200 " in first + rest


# 5: 10 queries at k=1000 got 3.1 MB back for a 202-byte body


def test_the_texts_of_one_answer_are_bounded_best_ranks_first(retriever: Retriever):
    queries = ["cats", "dogs", "stock market"]
    with client(retriever) as http:
        whole = http.post("/search", json={"query": queries, "k": 8}, headers=AUTH).json()
    sizes = [[len(h["title"] or "") + len(h["text"] or "") for h in row] for row in whole["results"]]
    assert whole["texts_left_out"] == 0 and all(all(size > 0 for size in row) for row in sizes)
    bound = sum(row[0] + row[1] for row in sizes)  # the first two ranks of every query
    with client(retriever, max_text_chars=bound) as http:
        bounded = http.post("/search", json={"query": queries, "k": 8}, headers=AUTH).json()
    kept = [[h["text"] is not None for h in row] for row in bounded["results"]]
    carried = sum(len(h["title"] or "") + len(h["text"] or "") for row in bounded["results"] for h in row)
    assert carried <= bound and all(row[:2] == [True, True] for row in kept)
    assert bounded["texts_left_out"] == sum(not k for row in kept for k in row) > 0
    ids = [[[h["id"] for h in row] for row in answer["results"]] for answer in (whole, bounded)]
    assert ids[0] == ids[1]
    assert all(h["title"] is None for row in bounded["results"] for h in row if h["text"] is None)


# 18: 20,000 pipelined GET /health got 2 answers, then 400 and the connection closed


def test_pipelined_requests_are_all_answered_and_one_request_still_bounded():
    pipelined = get(close=False) * 19_999 + get()
    flood_after = get(close=False) * 100 + get(headers={f"x-filler-{n}": "y" * 985 for n in range(2000)})
    with serving("ours") as port:
        answers = exchange(port, pipelined)
        flooded = exchange(port, flood_after)
    assert answers == ["200 0"] * 20_000
    assert flooded == ["200 0"] * 100 + ["400"]  # the refusal closes after every answer has gone


# 22: DENSEKIT_API_KEY set but blank served without a token


def test_a_blank_token_variable_is_refused(served, capsys, monkeypatch):
    from densekit.cli import serve_command

    _, index, model = served
    started: list = []
    monkeypatch.setattr(serve_command, "_serve_on", lambda app, *_: started.append(app))
    monkeypatch.setenv("DENSEKIT_API_KEY", " \t ")
    code, err, _ = cli(capsys, "serve", model, index, "--device", "cpu")
    assert (code, started) == (2, []) and "DENSEKIT_API_KEY" in err and "blank" in err, err


# 26: the client took timeout=0, -1 and NaN and failed later, and a user:password@ URL replaced the token


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf, True, "5"])
def test_a_timeout_that_is_not_a_positive_number_is_refused_when_the_client_is_made(timeout):
    with pytest.raises(DensekitError, match=r"^timeout=.*: give a number of seconds above 0"):
        Client("http://127.0.0.1:8000", TOKEN, timeout=timeout)


@pytest.mark.parametrize(("option", "value"), [("max_wait", math.nan), ("max_wait", -1), ("retries", -1),
                                               ("retries", 1.5)])  # fmt: skip
def test_other_settings_out_of_range_are_refused_when_the_client_is_made(option: str, value):
    with pytest.raises(DensekitError, match=rf"^{option}="):
        Client("http://127.0.0.1:8000", TOKEN, **{option: value})


def test_a_url_with_a_user_and_password_is_refused_rather_than_sent_instead_of_the_token():
    with pytest.raises(ServiceError, match="user name or password") as refused:
        Client("http://user:pw@127.0.0.1:8000", TOKEN)
    assert refused.value.status == 0 and "pw" not in str(refused.value)


# 27: "1_0" read as 10; two Host headers, only the last checked; `Host: localhost:` refused


@pytest.mark.parametrize(("route", "body"), [
    ("/search", {"query": "x", "k": "1_0"}),
    ("/search", {"query": "x", "k": "10"}),
    ("/v1/embeddings", {"input": "x", "model": "M", "dimensions": "32"}),
])  # fmt: skip
def test_a_number_sent_as_text_is_refused_as_a_boolean_is(retriever: Retriever, route: str, body: dict):
    body = {key: retriever.encoder.source if value == "M" else value for key, value in body.items()}
    with client(retriever) as http:
        refused = http.post(route, json=body, headers=AUTH)
    assert refused.status_code == 422 and "is text, not a number" in json.dumps(refused.json()), refused.text


def test_two_host_headers_are_refused_and_an_empty_port_is_none(retriever: Retriever):
    app = create_app(retriever, TOKEN, allowed_hosts=["127.0.0.1"])
    with in_thread(app) as url:
        port = _address(url)[1]
        for hosts, status in (((f"localhost:{port}", "rebind.attacker.example"), "400"),
                              (("rebind.attacker.example", f"localhost:{port}"), "400"),
                              (("localhost", "localhost"), "400"), (("localhost:",), "200"),
                              (("127.0.0.1:",), "200"), (("rebind.attacker.example:",), "403")):  # fmt: skip
            lines = "".join(f"Host: {name}\r\n" for name in hosts)
            request = f"GET /info HTTP/1.1\r\n{lines}Authorization: Bearer {TOKEN}\r\nConnection: close\r\n"
            request += "\r\n"
            statuses, _, _ = _held(url, [request.encode()])
            assert statuses == [status], (hosts, statuses)
