"""Issue 50's security cases on the HTTP service, in the issue's order: 1 (one bad text fails only its own
request), 2 (DNS rebinding: the Host header), 5 (response amplification) and 6 (metric labels a client
can add)."""

from __future__ import annotations

import asyncio
import json
import random
import string
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from densekit.retrieval.retriever import Retriever
from densekit.serving.app import Batching, create_app
from densekit.serving.batcher import MicroBatcher

from ..conftest import QUERIES
from ..service_fixtures import AUTH, TOKEN, client
from ..test_outputs import cli

LONE_SURROGATE = "\ud800"  # what the JSON escape \ud800 decodes to: no UTF-8 encodes it


def _raw_post(http: TestClient, path: str, body: dict) -> httpx.Response:
    """POST `body` as JSON with its non-ASCII characters escaped, as a hostile client may write them."""
    content = json.dumps(body).encode("ascii")
    return http.post(path, content=content, headers={**AUTH, "Content-Type": "application/json"})


# 1: a lone surrogate in one request answered 500 to every request batched with it


@pytest.mark.parametrize("route", ["/search", "/v1/embeddings"])
def test_a_lone_surrogate_fails_only_its_own_request_with_422(retriever: Retriever, route: str):
    texts = ["cats", "dogs", f"bad {LONE_SURROGATE} text", "python", "whales", "plants"]

    def body(text: str) -> dict:
        if route == "/search":
            return {"query": text, "k": 2}
        return {"input": [text], "model": retriever.encoder.source}

    # a long wait for company puts all six requests in one encoding batch
    app = create_app(retriever, TOKEN, batching=Batching(max_wait_ms=400))
    with TestClient(app, raise_server_exceptions=False) as http, ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(lambda text: _raw_post(http, route, body(text)), texts))
    statuses = [answer.status_code for answer in answers]
    assert statuses == [200, 200, 422, 200, 200, 200], [a.text[:200] for a in answers]
    said = json.dumps(answers[2].json())
    assert ("query 0" if route == "/search" else "input 0") in said and "surrogate" in said


def test_the_batcher_answers_each_request_alone_when_their_batch_fails(retriever: Retriever):
    # the service refuses a lone surrogate before it is queued; a text the tokenizer refuses in the
    # batcher itself must still fail only its own request
    texts = [q["text"] for q in QUERIES] + [LONE_SURROGATE, "dogs"]
    alone = {text: retriever.search(text, k=3)[0] for text in texts if text != LONE_SURROGATE}

    async def together() -> list:
        batcher = MicroBatcher(max_batch=64, max_wait_ms=300)
        await batcher.start()
        answers = await asyncio.gather(*(batcher.search(retriever, [t], 3) for t in texts),
                                       return_exceptions=True)  # fmt: skip
        await batcher.stop()
        return answers

    answers = asyncio.run(together())
    for text, answer in zip(texts, answers, strict=True):
        if text == LONE_SURROGATE:
            assert isinstance(answer, ValueError) and "could not be encoded" in str(answer), answer
        else:
            assert [h.id for h in answer[0]] == [h.id for h in alone[text]]


# 2: a service accepted any Host header, so a web page could reach it through DNS rebinding


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_host_header_naming_another_site_is_refused_with_403(retriever: Retriever, token: str | None):
    app = create_app(retriever, token, allowed_hosts=["127.0.0.1", "search.example.org"])
    headers = AUTH if token else {}
    with TestClient(app, base_url="http://127.0.0.1:8000") as http:

        def answer(host: str, path: str = "/info") -> httpx.Response:
            return http.get(path, headers={**headers, "Host": host})

        for host in ("rebind.attacker.example", "rebind.attacker.example:8000", "localhost.attacker.example",
                     "127.0.0.1.attacker.example", "evil@localhost", "localhost/x", "", "[::1"):  # fmt: skip
            refused = answer(host)
            assert refused.status_code == 403, (host, refused.text)
            assert "--allowed-host" in refused.json()["detail"] and "\n" not in refused.text
        openai_shape = answer("rebind.attacker.example", "/v1/models")
        assert openai_shape.status_code == 403 and "--allowed-host" in openai_shape.json()["error"]["message"]
        for host in ("localhost", "localhost:8000", "127.0.0.1", "127.0.0.1:8000", "[::1]:8000",
                     "LOCALHOST.", "app.localhost:8000", "search.example.org", "Search.Example.ORG:443",
                     "10.0.0.7:80"):  # fmt: skip
            assert answer(host).status_code == 200, host


def test_an_allowed_host_must_be_a_host_name(served, capsys):
    _, index, model = served
    for bad in ("http://proxy.example", "proxy.example:8080", "proxy.example/path", "a b"):
        code, err, _ = cli(capsys, "serve", model, index, "--allowed-host", bad)
        assert code == 2 and "--allowed-host" in err and "host name" in err, err


# 5: an 845-byte request got 20 MB back, and a 600 KB body of unknown keys a 2.4 MB 422


def test_a_request_may_ask_for_at_most_max_hits_hits(retriever: Retriever):
    queries = [f"query {n}" for n in range(64)]
    with client(retriever) as http:  # the defaults: 64 queries, k up to 1000, 10,000 hits
        refused = http.post("/search", json={"query": queries, "k": 1000}, headers=AUTH)
        assert refused.status_code == 422
        assert "64 queries x k=1000 = 64000 hits: ask for at most 10000" in refused.json()["detail"]
        assert http.post("/search", json={"query": queries, "k": 150}, headers=AUTH).status_code == 200
    with client(retriever, max_hits=20) as http:
        assert http.post("/search", json={"query": ["a", "b"], "k": 11}, headers=AUTH).status_code == 422
        assert http.post("/search", json={"query": ["a", "b"], "k": 10}, headers=AUTH).status_code == 200


@pytest.mark.parametrize("route", ["/search", "/v1/embeddings"])
def test_an_error_answer_stays_small_whatever_the_request_held(retriever: Retriever, route: str):
    base = {"query": "x"} if route == "/search" else {"input": "x", "model": retriever.encoder.source}
    unknown = {**base, **{f"x{n}": n for n in range(50_000)}}
    long_name = {**base, "module" if route == "/search" else "model": "m" * 500_000}
    answers = []
    with client(retriever) as http:
        for body in (unknown, long_name):
            content = json.dumps(body).encode()
            assert len(content) > 500_000
            refused = http.post(route, content=content, headers={**AUTH, "Content-Type": "application/json"})
            assert refused.status_code in (404, 422)
            assert len(refused.content) < 10_000, len(refused.content)
            answers.append(refused.json())
    listed, named = answers
    if route == "/search":
        assert listed["detail"][-1]["msg"] == "... and 49980 more problems"
        assert all(problem["loc"][1].startswith("x") for problem in listed["detail"][:-1])
        assert "module 'mmmm" in named["detail"] and "(500002 characters)" in named["detail"]
    else:
        assert "... and 49980 more problems" in listed["error"]["message"]
        assert "model 'mmmm" in named["error"]["message"]


# 6: /metrics took the HTTP method verbatim as a label


def test_made_up_methods_share_one_metrics_label(retriever: Retriever):
    randomly = random.Random(0)
    with client(retriever) as http:
        for _ in range(50):
            method = "".join(randomly.choices(string.ascii_uppercase, k=2000))
            assert http.request(method, "/search").status_code in (401, 405)
        scraped = http.get("/metrics", headers=AUTH).text
    methods = {
        sample.labels["method"]
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
        if "method" in sample.labels
    }
    assert methods == {"<other>"}  # one label for the 50 made up (the scrape counts itself after)
    assert len(scraped) < 20_000
