"""The service's metrics, its bounded queue (429 with Retry-After), request timeouts, and no request lost
under load."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from densekit.retrieval.retriever import Retriever
from densekit.serving.app import Batching, Limits, create_app
from densekit.serving.batcher import MicroBatcher, Overloaded, TimedOut

from .conftest import CORPUS, QUERIES
from .service_fixtures import AUTH, TOKEN, client


def _samples(scraped: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape, keyed by name and sorted labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
    }


def _requests(samples: dict, route: str, method: str, status: int) -> float:
    key = ("densekit_requests_total", (("method", method), ("route", route), ("status", str(status))))
    return samples.get(key, 0.0)


def test_metrics_count_a_scripted_sequence_of_requests_and_errors(retriever: Retriever):
    with client(retriever, max_body_bytes=300) as http:
        for text in ("cats", "dogs", "python"):
            assert http.post("/search", json={"query": text, "k": 2}, headers=AUTH).status_code == 200
        assert http.post("/search", json={"query": ["a", "b"], "k": 2}, headers=AUTH).status_code == 200
        assert http.post("/search", json={"query": "x"}).status_code == 401
        assert http.post("/search", json={"query": "x", "k": 0}, headers=AUTH).status_code == 422
        assert http.post("/search", json={"query": "z" * 400}, headers=AUTH).status_code == 413
        assert http.get("/documents/d1", headers=AUTH).status_code == 200
        assert http.get("/documents/nowhere", headers=AUTH).status_code == 404
        assert http.get("/no/such/path").status_code == 404
        assert http.post("/v1/embeddings", json={"input": ["a", "b", "c"], "model": retriever.encoder.source},
                         headers=AUTH).status_code == 200  # fmt: skip
        assert http.get("/metrics").status_code == 401  # behind the token unless opened
        batches = http.app.state.batcher.batches
        scraped = http.get("/metrics", headers=AUTH)
    assert scraped.headers["content-type"].startswith("text/plain")
    samples = _samples(scraped.text)
    assert _requests(samples, "/search", "POST", 200) == 4
    assert _requests(samples, "/search", "POST", 401) == 1
    assert _requests(samples, "/search", "POST", 422) == 1
    assert _requests(samples, "/search", "POST", 413) == 1
    assert _requests(samples, "/documents/{doc_id}", "GET", 200) == 1
    assert _requests(samples, "/documents/{doc_id}", "GET", 404) == 1
    assert _requests(samples, "<unmatched>", "GET", 404) == 1
    assert _requests(samples, "/v1/embeddings", "POST", 200) == 1
    assert _requests(samples, "/metrics", "GET", 401) == 1
    total = sum(v for (name, _), v in samples.items() if name == "densekit_requests_total")
    assert total == 12
    latency = samples[("densekit_request_duration_seconds_count", (("route", "/search"),))]
    assert latency == 7
    # each request's texts were encoded in batches of their own (they came one at a time)
    assert samples[("densekit_batch_texts_count", ())] == batches == 5
    assert samples[("densekit_batch_texts_sum", ())] == 3 + 2 + 3
    assert samples[("densekit_queue_texts", ())] == 0
    assert samples[("densekit_documents", ())] == len(CORPUS)
    assert samples[("densekit_index_vectors", (("module", ""),))] == len(CORPUS)


def test_metrics_can_be_opened_to_a_scraper_without_the_token(retriever: Retriever):
    with TestClient(create_app(retriever, TOKEN, open_metrics=True)) as http:
        assert http.get("/metrics").status_code == 200
        assert http.post("/search", json={"query": "x"}).status_code == 401


def test_past_the_queue_bound_requests_are_refused_at_once_with_retry_after(retriever: Retriever):
    async def flood() -> tuple[list, MicroBatcher]:
        batcher = MicroBatcher(max_batch=1, max_wait_ms=0, max_queued=3)
        await batcher.start()
        answers = await asyncio.gather(
            *(batcher.search(retriever, [f"query {i}"], 2) for i in range(6)), return_exceptions=True
        )
        await batcher.stop()
        return answers, batcher

    answers, batcher = asyncio.run(flood())
    served = [a for a in answers if isinstance(a, list)]
    refused = [a for a in answers if isinstance(a, Overloaded)]
    # the six arrive before the worker takes any: three wait, three are refused, none is left unanswered
    assert (len(served), len(refused)) == (3, 3)
    assert all(r.retry_after >= 1 for r in refused)
    assert batcher.batches == 3 and batcher.queued == 0

    with client(retriever, max_queued=1) as http:
        busy = http.post("/search", json={"query": ["a", "b"]}, headers=AUTH)
        fine = http.post("/search", json={"query": "a"}, headers=AUTH)
    assert busy.status_code == 429 and int(busy.headers["Retry-After"]) >= 1
    assert "busy" in busy.json()["detail"]
    assert fine.status_code == 200


def test_a_request_past_its_timeout_gets_503_and_its_queries_are_never_encoded(retriever: Retriever):
    async def late() -> tuple[object, int]:
        # the worker takes the request, then waits a second for company: longer than the timeout
        batcher = MicroBatcher(max_batch=64, max_wait_ms=1000, timeout=0.05)
        await batcher.start()
        answer = await asyncio.gather(batcher.search(retriever, ["cats"], 2), return_exceptions=True)
        await batcher.stop()
        return answer[0], batcher.batches

    answer, batches = asyncio.run(late())
    assert isinstance(answer, TimedOut) and answer.retry_after >= 1
    assert batches == 0

    # one worker, which waits for company (two would each take their share, half a request: at once)
    app = create_app(retriever, TOKEN, Limits(request_timeout_s=0.05), Batching(max_wait_ms=1000, workers=1))
    with TestClient(app) as http:
        refused = http.post("/search", json={"query": "cats"}, headers=AUTH)
        embedded = http.post("/v1/embeddings", json={"input": "cats", "model": retriever.encoder.source},
                             headers=AUTH)  # fmt: skip
    assert refused.status_code == 503 and "timeout of 0.05 s" in refused.json()["detail"]
    assert int(refused.headers["Retry-After"]) >= 1
    assert embedded.status_code == 503 and "timeout" in embedded.json()["error"]["message"]


def test_a_request_whose_client_leaves_is_not_encoded(retriever: Retriever):
    async def abandoned() -> int:
        batcher = MicroBatcher(max_batch=64, max_wait_ms=300)
        await batcher.start()
        task = asyncio.create_task(batcher.search(retriever, ["cats"], 2))
        await asyncio.sleep(0.05)  # taken by the worker, which waits for company
        task.cancel()
        await asyncio.sleep(0.5)
        await batcher.stop()
        return batcher.batches

    assert asyncio.run(abandoned()) == 0


@pytest.mark.parametrize("max_queued", [4, 1024])
def test_under_load_every_request_is_answered_200_or_429(retriever: Retriever, max_queued: int):
    app = create_app(retriever, TOKEN, Limits(max_queued=max_queued), Batching(max_wait_ms=20))
    texts = [q["text"] for q in QUERIES] * 16
    expected = {
        text: [h.id for h in hits] for text, hits in zip(texts, retriever.search(texts, k=3), strict=True)
    }

    async def load() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://service") as http:
                return await asyncio.gather(
                    *(http.post("/search", json={"query": t, "k": 3}, headers=AUTH) for t in texts)
                )

    responses = asyncio.run(load())
    assert len(responses) == len(texts)
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}
    if max_queued == 1024:
        assert statuses.count(200) == len(texts)
    else:
        assert statuses.count(429) > 0
    for text, response in zip(texts, responses, strict=True):
        if response.status_code == 200:
            assert [h["id"] for h in response.json()["results"][0]] == expected[text]


def test_a_free_worker_takes_every_waiting_request_without_waiting_for_more(retriever: Retriever):
    texts = [q["text"] for q in QUERIES] * 4

    async def together() -> tuple[list, int]:
        batcher = MicroBatcher(max_batch=64, max_wait_ms=0)
        await batcher.start()
        answers = await asyncio.gather(*(batcher.search(retriever, [t], 3) for t in texts))
        await batcher.stop()
        return answers, batcher.batches

    answers, batches = asyncio.run(together())
    assert batches == 1  # all sixteen were waiting when the worker woke
    for [hits], own in zip(answers, retriever.search(texts, k=3), strict=True):
        assert [h.id for h in hits] == [h.id for h in own]


def test_texts_gathered_together_are_encoded_a_few_at_a_time_to_the_same_hits(retriever: Retriever):
    texts = [q["text"] * (1 + i % 3) for i, q in enumerate(QUERIES * 3)]  # of several lengths

    async def together(encode_batch: int) -> tuple[list, list]:
        batcher = MicroBatcher(max_batch=64, max_wait_ms=0, encode_batch=encode_batch)
        await batcher.start()
        hits = await asyncio.gather(*(batcher.search(retriever, [t], 3) for t in texts))
        vectors = await batcher.embed(retriever, texts, "passage")
        await batcher.stop()
        return hits, vectors.vectors

    alone = retriever.search(texts, k=3)
    for encode_batch in (1, 3, 64):
        hits, vectors = asyncio.run(together(encode_batch))
        for [served], own in zip(hits, alone, strict=True):
            assert [h.id for h in served] == [h.id for h in own]
            assert [h.score for h in served] == pytest.approx([h.score for h in own], abs=1e-5)
        from densekit.encoding.embed import embed_texts

        expected = embed_texts(retriever.encoder, texts, "passage")
        assert abs(vectors - expected).max() < 1e-5
