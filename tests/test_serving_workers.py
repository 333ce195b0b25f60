"""Several encoding workers in the service: a batch encoded while the next is gathered, each worker on
its share of the threads and of the texts in flight, modules of one encoder never switched under a
worker, and every answer still the retriever's own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from densekit.data.dataset import Dataset
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.store import EmbeddingStore
from densekit.index import IndexSpec, build_index
from densekit.models import DenseEncoder
from densekit.retrieval.retriever import Retriever
from densekit.serving.app import Batching, create_app
from densekit.serving.batcher import MicroBatcher, _TokenizerLocks, default_workers

from .conftest import QUERIES
from .service_fixtures import TOKEN

TEXTS = [q["text"] for q in QUERIES]


@pytest.fixture
def kept_threads() -> Iterator[None]:
    """Torch's thread count as it was before the test, whatever the workers set."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(batcher: MicroBatcher, *requests) -> list:
    """Start `batcher`, send every (retriever, texts, k) at once, stop it, and return the answers."""

    async def together() -> list:
        await batcher.start()
        try:
            return await asyncio.gather(*(batcher.search(r, texts, k) for r, texts, k in requests))
        finally:
            await batcher.stop()

    return asyncio.run(together())


def test_a_client_alone_gets_every_thread_concurrent_batches_are_encoded_at_once_on_a_thread_each(
    retriever: Retriever, kept_threads
):
    calls: list[tuple[str, int]] = []
    overlap = threading.Barrier(2, timeout=10)  # the concurrent batches meet inside the model

    def record(module, args, kwargs) -> None:
        calls.append((threading.current_thread().name, torch.get_num_threads()))
        if len(calls) > 2:
            overlap.wait()

    async def alone_then_together() -> list:
        batcher = MicroBatcher(max_wait_ms=0, workers=2, threads=2)
        await batcher.start()
        try:
            answers = [await batcher.search(retriever, [text], 3) for text in TEXTS[:2]]
            together = (batcher.search(retriever, [text], 3) for text in TEXTS[:4])
            return answers + list(await asyncio.gather(*together))
        finally:
            await batcher.stop()

    hook = retriever.encoder.register_forward_pre_hook(record, with_kwargs=True)
    try:
        answers = asyncio.run(alone_then_together())
    finally:
        hook.remove()
    assert [threads for _, threads in calls[:2]] == [2, 2]  # a client alone: every thread
    # four at once: two batches of two (each worker's share), encoded at once on two threads, one each
    assert [threads for _, threads in calls[2:]] == [1, 1]
    assert calls[2][0] != calls[3][0]
    for text, [hits] in zip(TEXTS[:2] + TEXTS[:4], answers, strict=True):
        assert [h.id for h in hits] == [h.id for h in retriever.search([text], k=3)[0]]


def test_a_worker_gathers_its_share_of_the_texts_in_flight(retriever: Retriever, kept_threads):
    sizes: list[int] = []
    requests = [(retriever, [text], 2) for text in TEXTS[:4] * 2]
    answers = _run(MicroBatcher(max_wait_ms=0, workers=2, threads=2, on_batch=lambda n, _: sizes.append(n)),
                   *requests)  # fmt: skip
    assert sum(sizes) == 8 and max(sizes) <= 4  # eight in flight: at most four a worker
    alone: list[int] = []
    _run(MicroBatcher(max_wait_ms=0, on_batch=lambda n, _: alone.append(n)), *requests)
    assert alone == [8]  # one worker takes them all
    for (_, [text], _), [hits] in zip(requests, answers, strict=True):
        assert [h.id for h in hits] == [h.id for h in retriever.search([text], k=2)[0]]


def test_requests_of_different_k_in_one_batch_each_get_their_own_hits(retriever: Retriever):
    requests = [(retriever, [text], k) for text, k in zip(TEXTS * 2, [1, 3, 5, 2] * 3, strict=False)]
    sizes: list[int] = []
    answers = _run(MicroBatcher(max_wait_ms=0, on_batch=lambda n, _: sizes.append(n)), *requests)
    assert sizes == [len(requests)]  # searched together, a search for each k
    for (_, texts, k), answer in zip(requests, answers, strict=True):
        own = retriever.search(texts, k=k)
        assert [(h.id, h.text) for h in answer[0]] == [(h.id, h.text) for h in own[0]]
        # the last float32 bit of a score may change with the batch (exact_search)
        assert [h.score for h in answer[0]] == pytest.approx([h.score for h in own[0]], abs=1e-6)


def test_tokenizing_holds_one_lock_per_encoder_whatever_the_module():
    locks, shared = _TokenizerLocks(), object()
    first = SimpleNamespace(encoder=shared, module="first")
    second = SimpleNamespace(encoder=shared, module=None)
    assert locks.of(first) is locks.of(second)  # one tokenizer, whichever module encodes after
    assert locks.of(first) is not locks.of(SimpleNamespace(encoder=object(), module="first"))


def test_concurrent_searches_of_two_modules_get_each_modules_own_hits(served, tmp_path: Path, kept_threads):
    from .test_modules import put_module

    data, _, model = served
    encoder = DenseEncoder.load(model).eval()
    retrievers = []
    for name, seed in (("first", 1), ("second", 2)):
        put_module(encoder, "lora", name, seed=seed)
        encode_corpus(encoder, Dataset.open(data), tmp_path / f"emb-{name}", show_progress=False)
        build_index(EmbeddingStore.open(tmp_path / f"emb-{name}"), IndexSpec(), tmp_path / name,
                    show_progress=False)  # fmt: skip
        retrievers.append(Retriever.over(encoder, tmp_path / name, data))
    expected = {}
    for each in retrievers:
        expected[each.module] = [each.search([text], k=4)[0] for text in TEXTS]
    requests = [(each, [text], 4) for _ in range(3) for each in retrievers for text in TEXTS]
    answers = _run(MicroBatcher(max_wait_ms=0, workers=2, threads=2), *requests)
    for (each, [text], _), [hits] in zip(requests, answers, strict=True):
        own = expected[each.module][TEXTS.index(text)]
        assert [h.id for h in hits] == [h.id for h in own]
        assert [h.score for h in hits] == pytest.approx([h.score for h in own], abs=1e-5)


def test_two_workers_on_a_cpu_with_two_threads_one_otherwise(retriever: Retriever, kept_threads):
    torch.set_num_threads(2)
    assert default_workers(retriever) == 2
    assert create_app(retriever, TOKEN).state.batcher.workers == 2  # the service's default
    assert create_app(retriever, TOKEN, batching=Batching(workers=1)).state.batcher.workers == 1
    torch.set_num_threads(1)
    assert default_workers(retriever) == 1
    runtime, retriever.encoder.runtime = retriever.encoder.runtime, object()  # an ONNX export's session
    try:
        torch.set_num_threads(2)
        assert default_workers(retriever) == 1
    finally:
        retriever.encoder.runtime = runtime
