"""The service's answers are `Retriever.search`'s and `densekit encode`'s bit for bit, for concurrent
requests of mixed lengths gathered into shared batches; and what the service spends beside the model
(waits, thread hops, a second tokenisation) is gone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import anyio.to_thread
import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from densekit.data.dataset import Dataset
from densekit.encoding.store import EmbeddingStore
from densekit.retrieval.retriever import Retriever
from densekit.serving.app import Batching, create_app
from densekit.serving.batcher import MicroBatcher

from .conftest import QUERIES
from .service_fixtures import AUTH, TOKEN, serve_process

# Queries of several lengths (1 to 4 copies of each), so that gathered requests pad to each other.
MIXED = [" ".join([q["text"]] * (1 + n % 4)) for n, q in enumerate(QUERIES * 3)]


def _concurrently(app: FastAPI, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    """Send every (path, body) at once to `app`, as concurrent clients would, and return the answers."""

    async def send() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://service") as http:
                sent = (http.post(path, json=body, headers=AUTH) for path, body in requests)
                return await asyncio.gather(*sent)

    return asyncio.run(send())


def _app(retriever: Retriever, encode_batch: int) -> FastAPI:
    """The service over `retriever`, waiting long enough for every concurrent request to be gathered
    into one batch (one worker: two would each take half)."""
    gathered = Batching(max_wait_ms=500, encode_batch=encode_batch, workers=1)
    return create_app(retriever, TOKEN, batching=gathered)


@pytest.mark.parametrize("encode_batch", [16, 5])
def test_concurrent_searches_of_mixed_lengths_get_retriever_search_hits_bit_for_bit(
    retriever: Retriever, encode_batch: int
):
    app = _app(retriever, encode_batch)
    answers = _concurrently(app, [("/search", {"query": text, "k": 5}) for text in MIXED])
    assert app.state.batcher.batches == 1  # gathered together, then run `encode_batch` at a time
    expected = retriever.search(MIXED, k=5, batch_size=encode_batch)
    for answer, own in zip(answers, expected, strict=True):
        [served] = answer.json()["results"]
        assert [(h["id"], h["score"], h["title"], h["text"]) for h in served] == [
            (h.id, h.score, h.title, h.text) for h in own
        ]


def _encoded(served) -> dict[str, np.ndarray]:
    """`densekit encode`'s vectors of the served collection (the fixture's embedding folder), by id."""
    _, index, _ = served
    store = EmbeddingStore.open(Path(index).parent / "emb")
    return dict(zip(store.ids(), np.concatenate([part.vectors() for part in store.parts]), strict=True))


def test_concurrent_passage_embeddings_are_densekit_encodes_bit_for_bit(served, retriever: Retriever):
    documents = list(Dataset.open(served[0]).iter_corpus())
    model = retriever.encoder.source
    requests = [("/v1/embeddings", {"input": d.full_text, "model": f"{model}:passage"}) for d in documents]
    requests += [("/v1/embeddings", {"input": [d.full_text], "model": model, "encoding_format": "base64"})
                 for d in documents]  # fmt: skip
    answers = _concurrently(_app(retriever, 64), requests)
    encoded = _encoded(served)
    for (_, body), answer in zip(requests, answers, strict=True):
        [item] = answer.json()["data"]
        if body.get("encoding_format") == "base64":
            got = np.frombuffer(__import__("base64").b64decode(item["embedding"]), dtype="<f4")
        else:
            got = np.array(item["embedding"], dtype=np.float32)
        document = next(d for d in documents if d.full_text in (body["input"], body["input"][0]))
        assert got.tobytes() == encoded[document.id].tobytes()


def test_concurrent_query_embeddings_are_encode_queries_bit_for_bit(retriever: Retriever):
    model = f"{retriever.encoder.source}:query"
    requests = [("/v1/embeddings", {"input": text, "model": model}) for text in MIXED]
    answers = _concurrently(_app(retriever, 4), requests)
    got = np.array([answer.json()["data"][0]["embedding"] for answer in answers], dtype=np.float32)
    assert got.tobytes() == retriever.encode_queries(MIXED, batch_size=4).tobytes()
    tokens = [answer.json()["usage"]["prompt_tokens"] for answer in answers]
    assert tokens == [len(ids) for ids in retriever.encoder.tokenize(MIXED, "query")]


def test_requests_still_arriving_share_the_batch_without_a_timed_wait(retriever: Retriever):
    async def arriving() -> tuple[int, float]:
        batcher = MicroBatcher(max_wait_ms=0)
        await batcher.start()
        start = time.perf_counter()
        first = asyncio.create_task(batcher.search(retriever, [MIXED[0]], 3))
        await asyncio.sleep(0)  # the worker wakes with the first; the second comes a loop turn later
        second = asyncio.create_task(batcher.search(retriever, [MIXED[1]], 3))
        await asyncio.gather(first, second)
        took = time.perf_counter() - start
        await batcher.stop()
        return batcher.batches, took

    batches, took = asyncio.run(arriving())
    assert batches == 1
    assert took < 2.0  # a few loop turns of gathering, not a timed wait


def test_embeddings_tokenise_each_input_once(retriever: Retriever, monkeypatch):
    calls: list[int] = []
    tokenize = retriever.encoder.tokenize

    def counted(texts: list[str], side):
        calls.append(len(texts))
        return tokenize(texts, side)

    monkeypatch.setattr(retriever.encoder, "tokenize", counted)
    model = f"{retriever.encoder.source}:query"
    [answer] = _concurrently(_app(retriever, 16), [("/v1/embeddings", {"input": MIXED[:3], "model": model})])
    assert answer.status_code == 200
    assert calls == [3]


def test_a_request_takes_no_hop_through_the_thread_pool(retriever: Retriever, monkeypatch):
    hops: list[object] = []
    run_sync = anyio.to_thread.run_sync

    async def counted(function, *args, **kwargs):
        hops.append(function)
        return await run_sync(function, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    model = retriever.encoder.source
    requests = [("/search", {"query": "cats", "k": 2}), ("/v1/embeddings", {"input": "cats", "model": model})]
    answers = _concurrently(_app(retriever, 16), requests)
    assert [a.status_code for a in answers] == [200, 200]
    assert hops == []


def test_a_client_alone_is_not_kept_waiting_for_company(retriever: Retriever):
    async def one_at_a_time() -> list[float]:
        batcher = MicroBatcher(max_wait_ms=1000)
        await batcher.start()
        took = []
        for text in MIXED[:3]:
            start = time.perf_counter()
            await batcher.search(retriever, [text], 3)
            took.append(time.perf_counter() - start)
        await batcher.stop()
        return took

    took = asyncio.run(one_at_a_time())
    assert took[0] >= 1.0  # before any batch, the service's load is unknown: the first waits as told
    assert max(took[1:]) < 0.5  # the last batch held one request: the next is encoded at once


def test_serve_lets_idle_compute_threads_sleep_unless_told_otherwise(served, tmp_path: Path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    process, url = serve_process(served, tmp_path, "--encode-workers", "3")
    try:
        info = httpx.get(f"{url}/info", headers=AUTH).json()
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert info["omp_wait_policy"] == "PASSIVE"
    assert info["threads"] >= 1
    assert info["batching"]["workers"] == 3
