"""Issue 50's other cases on the HTTP service (14, 17, 19, 24, 25, 28, 30, 36, 37), then attacks of our
own on it: what each held or now refuses."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from densekit.encoding.embed import embed_texts
from densekit.index import SearchIndex
from densekit.models import DenseEncoder
from densekit.retrieval.documents import store_path
from densekit.retrieval.retriever import Retriever
from densekit.routing.route import Route
from densekit.routing.strategies import RouteSpec
from densekit.serving.app import Limits, create_app

from ..conftest import CORPUS, QUERIES
from ..service_fixtures import AUTH, ODD_IDS, TOKEN, client, in_thread, odd_ids_collection, serve_process
from ..test_modules import put_module
from ..test_outputs import cli

TEXTS = [q["text"] for q in QUERIES]
SERVED_AS = "tiny"  # the model name of the service over the wire


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory, tiny_st_model: Path, retriever: Retriever) -> Retriever:
    """A retriever over documents whose ids a URL path cannot carry as they are (ODD_IDS)."""
    data, index = odd_ids_collection(tmp_path_factory.mktemp("odd"), tiny_st_model)
    return Retriever.over(retriever.encoder, index, data)


@pytest.fixture(scope="module")
def service(odd: Retriever) -> Iterator[str]:
    """The service over `odd` under uvicorn (bodies up to 5000 bytes), for what only a real server
    shows: its URL."""
    app = create_app(odd, TOKEN, Limits(max_body_bytes=5000), model_name=SERVED_AS)
    with in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def routed(served) -> Retriever:
    """A fixed route over the served index: domain x to query-only module a, y to b, no fallback."""
    _, index, model = served
    encoder = DenseEncoder.load(model).eval()
    for seed, name in enumerate("ab", start=1):
        put_module(encoder, "query-lora", name, seed=seed)
    encoder.own = None
    route = Route(encoder, RouteSpec(type="fixed", modules=["a", "b"], domains={"x": "a", "y": "b"}))
    return Retriever(encoder, SearchIndex.load(index), route=route)


def _post_raw(http: httpx.Client, path: str, content: bytes | str, **headers: str) -> httpx.Response:
    return http.post(path, content=content, headers={**AUTH, "Content-Type": "application/json", **headers})


# 14: the document store removed while serving made every search in the batch answer 500


def test_search_answers_without_texts_when_the_document_store_is_removed(served, retriever, tmp_path, caplog):
    data, index, _ = served
    shutil.copytree(index, tmp_path / "index")
    own = Retriever.over(retriever.encoder, tmp_path / "index", data)  # its own store, beside the copy
    expected = own.search(TEXTS, k=3)
    with TestClient(create_app(own, TOKEN), raise_server_exceptions=False) as http:
        before = http.post("/search", json={"query": TEXTS, "k": 3}, headers=AUTH).json()
        store_path(tmp_path / "index").unlink()
        with caplog.at_level(logging.ERROR, logger="densekit"):
            after = [http.post("/search", json={"query": TEXTS, "k": 3}, headers=AUTH) for _ in range(3)]
            document = http.get("/documents/d1", headers=AUTH)
    assert before["results"][0][0]["text"] and before.get("documents_unavailable") is None
    for answer in after:
        assert answer.status_code == 200, answer.text
        assert answer.json()["documents_unavailable"].endswith("is gone: No such file or directory")
        for hits, own_hits in zip(answer.json()["results"], expected, strict=True):
            assert [(h["id"], h["title"], h["text"]) for h in hits] == [(h.id, None, None) for h in own_hits]
    assert document.status_code == 503 and "document store" in document.json()["detail"]
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR and "document store" in r.getMessage()]
    assert len(logged) == 1


# 17: a memory-mapped index file truncated in place killed the service without a log line


def test_a_mapped_index_truncated_in_place_gets_503_and_a_log_line(served, tmp_path: Path):
    data, index, model = served
    shutil.copytree(index, tmp_path / "index")
    process, url = serve_process((data, tmp_path / "index", model), tmp_path, "--mmap-index")
    try:
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
            assert http.post("/search", json={"query": "cats"}).status_code == 200
            with open(tmp_path / "index" / "index.faiss", "r+b") as mapped:
                mapped.truncate(0)  # as `> index.faiss` or a copy over it would, before writing
            refused = [http.post("/search", json={"query": "cats"}) for _ in range(2)]
            assert http.get("/health").status_code == 200 and process.poll() is None
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0]
    assert [answer.status_code for answer in refused] == [503, 503]
    assert "changed in place while served" in refused[0].json()["detail"]
    assert output.count("changed in place while served") == 1, output


# 19: ids holding `/` could not be served


def test_documents_whose_ids_hold_a_slash_or_other_url_syntax_are_served(service: str):
    with httpx.Client(base_url=service, headers=AUTH, timeout=30) as http:
        for doc_id in ODD_IDS:
            escaped = quote(doc_id, safe="")
            escaped = escaped.replace(".", "%2E") if escaped in (".", "..") else escaped
            found = http.get(f"/documents/{escaped}")
            assert found.status_code == 200 and found.json()["id"] == doc_id, (doc_id, found.text)
        assert http.get("/documents/a/b").json()["title"] == "title of a/b"


# 24: `serve --backend onnx --module ...` failed to export an adapter module


def test_an_adapter_module_is_exported_to_onnx_runtime_and_encodes_as_torch(tiny_st_model: Path):
    from densekit.encoding.runtimes import use_backend

    encoder = DenseEncoder.load(tiny_st_model).eval()
    put_module(encoder, "adapter", "adapter", seed=1)  # its own, as `serve --module` loads it
    texts = TEXTS + [d["text"] for d in CORPUS[:3]]
    by_torch = {kind: embed_texts(encoder, texts, kind) for kind in ("query", "passage")}
    trainable = [p.requires_grad for p in encoder.parameters()]
    use_backend(encoder, "onnx", "float32")
    assert encoder.runtime is not None and [p.requires_grad for p in encoder.parameters()] == trainable
    for kind, expected in by_torch.items():
        np.testing.assert_allclose(embed_texts(encoder, texts, kind), expected, atol=1e-5)


# 25: /v1/models listed ROUTE:query, which a fixed route without a fallback can never answer


def test_a_fixed_routes_query_models_name_their_domain(routed: Retriever):
    with TestClient(create_app(routed, TOKEN, model_name="routed")) as http:
        listed = {model["id"] for model in http.get("/v1/models", headers=AUTH).json()["data"]}
        answers = {
            domain: http.post("/v1/embeddings", json={"input": TEXTS, "model": f"routed:query@{domain}"},
                              headers=AUTH)
            for domain in "xy"
        }  # fmt: skip
    assert listed == {"routed", "routed:passage", "routed:query@x", "routed:query@y"}
    vectors = {}
    for domain, answer in answers.items():
        assert answer.status_code == 200, answer.text
        vectors[domain] = np.array([item["embedding"] for item in answer.json()["data"]])
        expected = routed.route.encode_queries(TEXTS, [domain] * len(TEXTS))
        np.testing.assert_allclose(vectors[domain], expected, atol=1e-5)
    assert np.abs(vectors["x"] - vectors["y"]).max() > 1e-3  # each domain went to its own module


# 30: a route served without a domain answered "domain None is not routed here"


def test_a_query_without_the_domain_a_fixed_route_needs_is_told_how_to_send_one(routed: Retriever):
    with TestClient(create_app(routed, TOKEN, model_name="routed")) as http:
        searched = http.post("/search", json={"query": "cats"}, headers=AUTH)
        embedded = http.post("/v1/embeddings", json={"input": "cats", "model": "routed:query"}, headers=AUTH)
        assert http.post("/search", json={"query": "cats", "domain": "y"}, headers=AUTH).status_code == 200
    said = searched.json()["detail"]
    assert searched.status_code == 422 and 'send one as "domain"' in said and "'x', 'y'" in said
    assert "None" not in said
    assert embedded.status_code == 404 and "'routed:query@x'" in embedded.json()["error"]["message"]


# 28: a second `serve` on a busy port loaded everything, then exited 3


def test_a_serve_on_a_port_in_use_fails_at_once_with_status_2(served, tmp_path: Path, capsys):
    _, index, model = served
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # an index that does not exist: the port is checked before anything is loaded
        for index_dir in (tmp_path / "no-index", index):
            code, err, _ = cli(capsys, "serve", model, index_dir, "--port", port)
            assert code == 2, err
            assert f"--port {port}: cannot listen there (Address already in use)" in err


# 36: texts of only NUL or zero-width characters passed the empty check


INVISIBLE = ["\x00", "\x00\x00\x00", "\u200b\u200c\u200d", "\ufeff", "\u00ad", "\u2060", "\u3164", "\u2800",
             " \t\u200b\x00\u2028\u3000", "\u0301\u0301", "\ue000"]  # fmt: skip


@pytest.mark.parametrize("text", INVISIBLE)
def test_a_text_of_only_invisible_characters_is_empty(retriever: Retriever, text: str):
    with client(retriever) as http:
        searched = http.post("/search", json={"query": ["cats", text]}, headers=AUTH)
        body = {"input": ["cats", text], "model": retriever.encoder.source}
        embedded = http.post("/v1/embeddings", json=body, headers=AUTH)
    assert searched.status_code == 422 and "query 1 is empty" in searched.json()["detail"]
    assert embedded.status_code == 422 and "input 1 is empty" in embedded.json()["error"]["message"]


def test_a_text_with_something_visible_among_invisible_characters_is_searched(retriever: Retriever):
    with client(retriever) as http:
        for text in ("\u200bcats\u200b", "\x00a", "é", "e\u0301", "😀", "\u3164x"):
            assert http.post("/search", json={"query": text}, headers=AUTH).status_code == 200, text


# 37: a 413 under /v1/ came in a shape the OpenAI client cannot read


def test_a_413_under_v1_is_in_openais_shape(retriever: Retriever):
    with client(retriever, max_body_bytes=300) as http:
        declared = http.post("/v1/embeddings", json={"input": "x" * 400, "model": "m"}, headers=AUTH)

        def chunks() -> Iterator[bytes]:
            yield b'{"input": "' + b"x" * 400 + b'", "model": "m"}'

        undeclared = _post_raw(http, "/v1/embeddings", chunks())
    for refused in (declared, undeclared):
        assert refused.status_code == 413
        assert refused.json()["error"]["message"] == "request body over 300 bytes"


def test_the_openai_client_reads_a_413s_message(service: str):
    openai_client = openai.OpenAI(base_url=f"{service}/v1", api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        openai_client.embeddings.create(input=["x" * 6000], model=SERVED_AS)
    assert refused.value.status_code == 413
    assert refused.value.message == "Error code: 413 - request body over 5000 bytes"


# attacks of our own


def test_serve_checks_the_host_header_against_the_names_it_was_given(served, capsys, monkeypatch):
    from densekit.cli import serve_command

    _, index, model = served
    started: list = []
    monkeypatch.setattr(serve_command, "_serve_on", lambda app, *_: started.append(app))
    monkeypatch.delenv("DENSEKIT_API_KEY", raising=False)
    code, err, _ = cli(capsys, "serve", model, index, "--allowed-host", "Search.Example.org", "--device",
                       "cpu")  # fmt: skip
    assert code == 0, err
    with TestClient(started[0]) as http:
        assert http.get("/info", headers={"Host": "search.example.org:8000"}).status_code == 200
        assert http.get("/info", headers={"Host": "localhost:8000"}).status_code == 200
        refused = http.get("/info", headers={"Host": "rebind.example:8000"})
    assert refused.status_code == 403 and "--allowed-host" in refused.json()["detail"]


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        ("/search", '{"query": "x", "k": true}', "true is not a number"),
        ("/search", '{"query": "x", "k": false}', "false is not a number"),
        ("/v1/embeddings", '{"input": "x", "model": "M", "dimensions": true}', "true is not a number"),
        ("/search", '{"query": "x", "k": NaN}', "finite number"),
        ("/search", '{"query": "x", "k": Infinity}', "finite number"),
        ("/search", '{"query": "x", "k": 1e400}', "finite number"),
        ("/search", '{"query": "x", "k": 2.5}', "fractional part"),
        ("/search", '{"query": "x", "k": -1}', "k=-1: ask for 1 to 1000"),
        ("/search", '{"query": "x", "k": 100000000000000000000}', "ask for 1 to 1000"),
        ("/search", '{"query": [["x"]]}', "valid string"),
        ("/search", '{"query": [1, 2]}', "valid string"),
        ("/search", '{"query": []}', "0 queries: send 1 to 64"),
        ("/search", "null", "valid dictionary"),
        ("/search", '["x"]', "valid dictionary"),
        ("/v1/embeddings", '{"input": [], "model": "M"}', "0 inputs: send 1 to 64"),
        ("/v1/embeddings", '{"input": "x", "model": "M", "encoding_format": "BASE64"}', "'base64'"),
        ("/v1/embeddings", '{"input": "x", "model": "M", "encoding_format": null}', "'float' or 'base64'"),
        ("/v1/embeddings", '{"input": "x", "model": "M", "dimensions": -32}', "dimensions=-32"),
    ],
)
def test_odd_numbers_and_shapes_are_refused_with_422_naming_the_field(retriever, route, body, says):
    with client(retriever) as http:
        refused = _post_raw(http, route, body.replace('"M"', json.dumps(retriever.encoder.source)))
        assert http.post("/search", json={"query": "cats"}, headers=AUTH).status_code == 200
    assert refused.status_code == 422, refused.text
    assert says in json.dumps(refused.json()), refused.text


UNREADABLE = ['{"query": "x", "k": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000,
              b'{"query": "\xff\xfe"}', '{"query": "x"']  # fmt: skip


@pytest.mark.parametrize("body", UNREADABLE)
def test_bodies_json_cannot_read_get_400_and_the_service_goes_on(retriever: Retriever, body):
    with client(retriever) as http:
        refused = _post_raw(http, "/search", body)
        openai_shape = _post_raw(http, "/v1/embeddings", body)
        assert http.post("/search", json={"query": "cats"}, headers=AUTH).status_code == 200
    assert refused.status_code in (400, 422) and len(refused.content) < 2000
    assert openai_shape.status_code in (400, 422) and openai_shape.json()["error"]["message"]


def test_a_json_body_sent_as_a_form_or_text_is_not_read(retriever: Retriever):
    # a web page may POST text/plain across sites without asking first: its body must not be taken as JSON
    with client(retriever) as http:
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            refused = _post_raw(http, "/search", '{"query": "cats"}', **{"Content-Type": kind})
            assert refused.status_code in (400, 422) and "results" not in refused.text, kind


def test_duplicate_keys_take_the_last_value_as_json_readers_do(retriever: Retriever):
    with client(retriever) as http:
        twice = _post_raw(http, "/search", '{"query": "cats", "k": 1, "k": 3}')
    assert twice.status_code == 200 and len(twice.json()["results"][0]) == 3


def test_surrogate_pairs_and_a_query_of_2000_emoji_are_searched(retriever: Retriever):
    with client(retriever) as http:
        pair = _post_raw(http, "/search", '{"query": "\\ud83d\\ude00 cats"}')
        emoji = http.post("/search", json={"query": "😀" * 2000}, headers=AUTH)
        one_more = http.post("/search", json={"query": "😀" * 2001}, headers=AUTH)
    assert pair.status_code == 200 and emoji.status_code == 200
    assert one_more.status_code == 422 and "2001 characters" in one_more.json()["detail"]


@pytest.mark.parametrize("method", ["OPTIONS", "TRACE", "PUT", "DELETE", "PATCH"])
def test_methods_the_routes_do_not_take_get_405_and_no_data(retriever: Retriever, method: str):
    with client(retriever) as http:
        for path in ("/search", "/documents/d1", "/info", "/v1/embeddings"):
            answer = http.request(method, path, headers=AUTH)
            assert answer.status_code == 405 and "Python" not in answer.text


def test_health_answers_a_head_probe(retriever: Retriever):
    with client(retriever) as http:  # load balancers probe with HEAD; it needs no token, and gets no body
        answer = http.head("/health")
        assert answer.status_code == 200 and answer.content == b""


def test_path_tricks_in_a_document_id_reach_no_other_route(retriever: Retriever):
    with client(retriever) as http:
        for path in ("/documents/..%2Finfo", "/documents/..%2F..%2Fetc%2Fpasswd", "/documents/%2E%2E",
                     "/documents/d1%00"):  # fmt: skip
            answer = http.get(path, headers=AUTH)
            assert answer.status_code == 404 and answer.json()["detail"].startswith("no document"), path
        injected = http.get("/documents/d1%0D%0ASet-Cookie:%20x=1", headers=AUTH)  # ids hold no line break
        assert injected.status_code == 404 and "set-cookie" not in injected.headers
        assert http.get("/documents/..%2Finfo").status_code == 401  # and the token is still needed


NEAR_MISSES = [f"bearer{TOKEN}", f"Bearer {TOKEN.upper()}", f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}",
               f"Bearer {TOKEN}x", "Bearer " + "".join(chr(ord(c) + 0xFEE0) for c in TOKEN),
               f"Bearer {TOKEN}\u200b", TOKEN]  # fmt: skip


@pytest.mark.parametrize("authorization", NEAR_MISSES)
def test_near_miss_tokens_are_refused(retriever: Retriever, authorization: str):
    with client(retriever) as http:
        answer = http.get("/info", headers={"Authorization": authorization.encode()})
    assert answer.status_code == 401, authorization


@pytest.mark.parametrize("token", ["sécret-token", "tab\tinside", "zero\u200bwidth"])
def test_serve_refuses_a_token_an_http_header_cannot_carry(served, tmp_path, capsys, monkeypatch, token):
    from densekit.cli import serve_command

    _, index, model = served
    (tmp_path / "key").write_text(token + "\n", encoding="utf-8")
    monkeypatch.setattr(serve_command, "_serve_on", lambda *_: None)  # never serve, whatever happens
    code, err, _ = cli(capsys, "serve", model, index, "--api-key-file", tmp_path / "key")
    assert code == 2 and "key:1: the token holds characters other than printable ASCII" in err


def test_model_names_that_almost_name_a_served_one_get_404_listing_the_served(retriever: Retriever):
    name = retriever.encoder.source
    with client(retriever) as http:
        for model in (f"{name}:query@x", f"{name}:passage:query", f"{name}:QUERY", ":" * 10_000, f"{name} ",
                      f"{name}:query:"):  # fmt: skip
            refused = http.post("/v1/embeddings", json={"input": "x", "model": model}, headers=AUTH)
            message = refused.json()["error"]["message"]
            assert refused.status_code == 404 and f"'{name}:query'" in message and len(message) < 2000


def test_concurrent_requests_for_one_id_and_one_query_get_the_same_answer(retriever: Retriever):
    with client(retriever) as http, ThreadPoolExecutor(8) as pool:
        documents = list(pool.map(lambda _: http.get("/documents/d4", headers=AUTH).json(), range(16)))
        searches = list(pool.map(lambda _: http.post("/search", json={"query": "cats", "k": 3},
                                                     headers=AUTH).json()["results"], range(16)))  # fmt: skip
    assert all(document == documents[0] for document in documents)
    assert all([h["id"] for h in found[0]] == [h["id"] for h in searches[0][0]] for found in searches)


def test_a_slow_body_holds_no_other_request_back(service: str):
    host, port = service.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as slow:
        slow.sendall(f"POST /search HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())  # fmt: skip
        started = time.perf_counter()
        answer = httpx.post(f"{service}/search", json={"query": "cats"}, headers=AUTH, timeout=30)
        assert answer.status_code == 200 and time.perf_counter() - started < 10


def test_a_flood_of_headers_is_refused_and_the_service_goes_on(service: str):
    flood = {f"x-flood-{n}": "y" * 1000 for n in range(2000)}  # 2 MB of headers
    try:
        refused = httpx.get(f"{service}/health", headers=flood, timeout=30).status_code
    except httpx.TransportError:  # the server may close the connection instead of answering
        refused = None
    assert refused in (400, 431, None)
    assert httpx.get(f"{service}/health", timeout=30).status_code == 200


def test_many_slow_connections_leave_the_service_answering(service: str):
    host, port = service.removeprefix("http://").split(":")
    opened = [socket.create_connection((host, int(port))) for _ in range(50)]
    try:
        for connection in opened:
            connection.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # never finished
        assert httpx.get(f"{service}/health", timeout=30).status_code == 200
    finally:
        for connection in opened:
            connection.close()
