"""`densekit.Client` against hostile or broken services: issue 50's client cases (19: ids are escaped;
37: what stops an answer is a `ServiceError`), then attacks of our own. A hostile service is an
`httpx.MockTransport` answering as one would; the client under test is the real one."""

from __future__ import annotations

import base64
import email.utils
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from densekit import client as client_module
from densekit.client import Client, ServiceError
from densekit.retrieval.retriever import Retriever
from densekit.serving.app import create_app

from ..service_fixtures import ODD_IDS, TOKEN, free_port, in_thread, odd_ids_collection

SERVICE = "http://service.example"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_st_model: Path, retriever: Retriever
            ) -> Iterator[str]:  # fmt: skip
    """The service over documents whose ids a URL cannot carry as they are, under uvicorn: its URL."""
    data, index = odd_ids_collection(tmp_path_factory.mktemp("odd"), tiny_st_model)
    with in_thread(create_app(Retriever.over(retriever.encoder, index, data), TOKEN)) as url:
        yield url


def hostile(handler: Callable[[httpx.Request], httpx.Response], **options) -> Client:
    """A client of a service that answers every request with `handler`."""
    http = httpx.Client(transport=httpx.MockTransport(handler), follow_redirects=options.pop("follow", False))
    return Client(SERVICE, TOKEN, http=http, **options)


def answering(status: int, body: object, **headers: str) -> Callable[[httpx.Request], httpx.Response]:
    """A handler answering `status` with `body` (bytes or text as they are, anything else as JSON)."""

    def handler(_: httpx.Request) -> httpx.Response:
        if isinstance(body, bytes | str):
            return httpx.Response(status, content=body, headers=headers)
        return httpx.Response(status, json=body, headers=headers)

    return handler


# 19: Client.document did not escape ids ('4983?x=1' returned 4983, '../info' raised a TypeError)


def test_the_client_fetches_every_document_by_its_own_id(service: str):
    with Client(service, TOKEN) as densekit_client:
        for doc_id in ODD_IDS:
            assert densekit_client.document(doc_id).id == doc_id
        with pytest.raises(ServiceError, match=r"404: no document 'd1\?x=2'"):
            densekit_client.document("d1?x=2")
        with pytest.raises(ServiceError, match=r"404: no document '\.\./search'"):
            densekit_client.document("../search")


def test_the_client_sends_an_id_as_one_escaped_path_segment():
    sent: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.raw_path)
        return httpx.Response(200, json={"id": "x", "score": 0.0})

    escaped = {"../info": "..%2Finfo", "a/b": "a%2Fb", "d1?x=1": "d1%3Fx%3D1", "c#1": "c%231",
               "100%": "100%25", "..": "%2E%2E", ".": "%2E", "with space": "with%20space", "ün": "%C3%BCn",
               "a%2Fb": "a%252Fb", "": ""}  # fmt: skip
    with hostile(handler) as densekit_client:
        for doc_id in escaped:
            densekit_client.document(doc_id)
    assert sent == [f"/documents/{segment}".encode() for segment in escaped.values()]


# 37: connection errors, bad URLs and non-JSON answers surfaced as raw httpx or JSON errors


def test_a_service_that_cannot_be_reached_is_a_service_error_of_status_0():
    nobody = Client(f"http://127.0.0.1:{free_port()}", TOKEN)
    with nobody, pytest.raises(ServiceError) as refused:
        nobody.search("cats")
    assert refused.value.status == 0 and "cannot be reached" in str(refused.value)


NOT_HTTP = "not an http(s) URL with a host"
BAD_URLS = [("localhost:8000", NOT_HTTP), ("ftp://127.0.0.1", NOT_HTTP), ("http://", NOT_HTTP),
            ("not a url", NOT_HTTP), ("", NOT_HTTP), ("file:///etc/passwd", NOT_HTTP),
            ("http://h:99999", "port 99999: a port is 1 to 65535"),
            ("http://h/?q=1", "give the service's URL without a query"),
            ("http://h/#top", "give the service's URL without a query")]  # fmt: skip


@pytest.mark.parametrize(("url", "says"), BAD_URLS)
def test_a_bad_url_is_a_service_error_of_status_0(url: str, says: str):
    with pytest.raises(ServiceError) as refused:
        Client(url, TOKEN).search("cats")
    assert refused.value.status == 0 and refused.value.detail.startswith(says)


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (200, b"<html><body>a captive portal</body></html>", "200: the answer is not JSON: '<html><body>"),
        (200, b"", "200: the answer is not JSON: ''"),
        (200, {"results": 5}, "200: unexpected answer: results: Input should be a valid list"),
        (200, {"results": [[{"id": 1, "score": 0.5}]]}, "200: unexpected answer: results.0.0.id"),
        (200, {"results": [[{"id": "d1", "score": "high"}]]}, "200: unexpected answer: results.0.0.score"),
        (200, [1, 2], "200: unexpected answer: the answer"),
        (502, b"<html>\n<h1>502 Bad Gateway</h1>\n</html>\n", "502: <html> <h1>502 Bad Gateway</h1> </html>"),
        (500, b"x" * 1_000_000, "500: " + "x" * 300 + "... (1000000 characters)"),
    ],
)
def test_an_answer_that_is_not_the_services_is_a_service_error(status: int, body, says: str):
    densekit_client = hostile(answering(status, body), retries=0)
    with densekit_client, pytest.raises(ServiceError) as refused:
        densekit_client.search("cats")
    said = str(refused.value)
    assert said.startswith(f"{SERVICE}/search: {says}"), said
    assert refused.value.status == status and "\n" not in said and len(said) < 400


# attacks of our own


def test_a_redirect_is_not_followed_and_the_token_goes_to_no_other_host():
    calls: list[tuple[str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append((request.url.host, request.headers.get("Authorization")))
        if request.url.host == "service.example":
            return httpx.Response(307, headers={"Location": "http://elsewhere.example/search"})
        return httpx.Response(200, json={"results": [[]]})

    densekit_client = hostile(handler)
    with densekit_client, pytest.raises(ServiceError) as refused:
        densekit_client.search("cats")
    assert refused.value.status == 307
    assert refused.value.detail.startswith("redirected to http://elsewhere.example/search")
    assert calls == [("service.example", f"Bearer {TOKEN}")]
    calls.clear()
    with hostile(handler, follow=True) as following:  # an http client of the user's that follows them
        assert following.search("cats") == [[]]
    assert calls == [("service.example", f"Bearer {TOKEN}"), ("elsewhere.example", None)]


def _in(seconds: float) -> str:
    return email.utils.formatdate(time.time() + seconds, usegmt=True)


RETRY_AFTERS = [("1e400", 5.0), ("inf", 5.0), ("999999999", 5.0), ("-5", 0.0), ("-inf", 0.0), ("NaN", 1.0),
                ("soon", 1.0), ("", 1.0), ("0.25", 0.25), ("in 3 s", 1.0)]  # fmt: skip


@pytest.mark.parametrize(("retry_after", "waited"), RETRY_AFTERS)
def test_retry_after_is_bounded_whatever_it_says(monkeypatch, retry_after: str, waited: float):
    waits: list[float] = []
    monkeypatch.setattr(client_module.time, "sleep", waits.append)
    answers = iter([httpx.Response(429, json={"detail": "busy"}, headers={"Retry-After": retry_after}),
                    httpx.Response(200, json={"results": [[]]})])  # fmt: skip
    with hostile(lambda _: next(answers), max_wait=5.0) as densekit_client:
        assert densekit_client.search("cats") == [[]]
    assert waits == [pytest.approx(waited)]


@pytest.mark.parametrize(("ahead", "waited"), [(3, 3.0), (-60, 0.0), (3600, 5.0)])
def test_retry_after_as_an_http_date_waits_until_then(monkeypatch, ahead: float, waited: float):
    waits: list[float] = []
    monkeypatch.setattr(client_module.time, "sleep", waits.append)
    answers = iter([httpx.Response(503, json={"detail": "late"}, headers={"Retry-After": _in(ahead)}),
                    httpx.Response(200, json={"results": [[]]})])  # fmt: skip
    with hostile(lambda _: next(answers), max_wait=5.0) as densekit_client:
        densekit_client.search("cats")
    assert waits == [pytest.approx(waited, abs=1.1)]


def _packed(*values: float) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ([{"embedding": base64.b64encode(b"\0" * 10).decode(), "index": n} for n in (0, 1)], "10 bytes"),
        ([{"embedding": "not base64!", "index": 0}, {"embedding": _packed(1), "index": 1}], "not base64"),
        ([{"embedding": _packed(1, 2), "index": 0}, {"embedding": _packed(1), "index": 1}], "several sizes"),
        ([{"embedding": _packed(1), "index": 0}], "1 embeddings, not one each for 2 texts"),
        ([{"embedding": _packed(1), "index": 1}, {"embedding": _packed(2), "index": 1}], "not one each"),
        ([{"embedding": [0.1, 0.2], "index": 0}, {"embedding": [0.1, 0.2], "index": 1}], "data.0.embedding"),
        ([{"index": 0}, {"index": 1}], "data.0.embedding: Field required"),
    ],
)
def test_embeddings_that_do_not_decode_to_one_row_each_are_a_service_error(data: list, says: str):
    densekit_client = hostile(answering(200, {"data": data}))
    with densekit_client, pytest.raises(ServiceError) as refused:
        densekit_client.embed(["a", "b"], model="m")
    assert refused.value.status == 200 and says in str(refused.value)


def test_embeddings_come_back_in_the_order_of_their_index():
    data = [{"embedding": _packed(2, 2), "index": 1}, {"embedding": _packed(1, 1), "index": 0}]
    with hostile(answering(200, {"data": data})) as densekit_client:
        vectors = densekit_client.embed(["a", "b"], model="m")
    assert vectors.tolist() == [[1, 1], [2, 2]]


@pytest.mark.parametrize("token", [f"{TOKEN}\nX-Injected: 1", f"{TOKEN}\r\n", "sécret", "tab\there", "\x00"])
def test_a_token_an_http_header_cannot_carry_is_refused_at_once(token: str):
    with pytest.raises(ValueError, match="token: holds a line break"):
        Client(SERVICE, token)


def test_a_service_that_never_answers_is_a_service_error_after_the_timeout():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # the kernel accepts the connection; nobody ever answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.perf_counter()
        densekit_client = Client(url, TOKEN, timeout=0.5)
        with densekit_client, pytest.raises(ServiceError) as refused:
            densekit_client.search("cats")
    assert refused.value.status == 0 and "timeout" in str(refused.value)
    assert time.perf_counter() - started < 5


def test_odd_but_valid_urls_reach_the_service_under_them():
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(f"{request.url.host}{request.url.path}")
        return httpx.Response(200, json={"results": [[]]})

    for url in ("http://service.example///", "http://service.example/prefix/", "HTTP://Service.Example"):
        http = httpx.Client(transport=httpx.MockTransport(handler))
        with Client(url, TOKEN, http=http) as densekit_client:
            densekit_client.search("cats")
    assert paths == ["service.example/search", "service.example/prefix/search", "service.example/search"]


@pytest.mark.parametrize("info", [[1, 2], {"embedding_models": []}, {"embedding_models": "m"}, {}])
def test_an_info_answer_without_model_names_is_a_service_error(info):
    densekit_client = hostile(answering(200, info))
    with densekit_client, pytest.raises(ServiceError) as refused:
        densekit_client.embed(["a"])
    assert refused.value.status == 200


def test_a_list_of_validation_problems_is_told_on_one_line():
    problems = {"detail": [{"loc": ["body", "k"], "msg": "Input should be\na valid integer", "type": "int"}]}
    densekit_client = hostile(answering(422, problems))
    with densekit_client, pytest.raises(ServiceError) as refused:
        densekit_client.search("cats", k=5)
    said = str(refused.value)
    assert refused.value.status == 422 and "a valid integer" in said and "\n" not in said


def test_a_service_busy_every_time_is_given_up_on_after_the_retries(monkeypatch):
    monkeypatch.setattr(client_module.time, "sleep", lambda _: None)
    calls = []

    def busy(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(429, json={"detail": "busy"}, headers={"Retry-After": "1"})

    with hostile(busy, retries=2) as densekit_client, pytest.raises(ServiceError, match="429: busy"):
        densekit_client.search("cats")
    assert len(calls) == 3
