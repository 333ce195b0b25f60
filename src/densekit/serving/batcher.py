"""Gathering concurrent requests' queries into one encoding batch, so throughput grows with concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from densekit.encoding.device import Precision
from densekit.retrieval.retriever import Hit, Retriever


@dataclass
class _Pending:
    retriever: Retriever
    texts: list[str]
    k: int
    done: asyncio.Future = field(repr=False)
    domain: str | None = None


class MicroBatcher:
    """Queues each request's queries; one worker takes the first waiting request, gathers what else
    arrives within `max_wait_ms` (up to `max_batch` queries), encodes them in one batch per module off
    the event loop, and answers every request from it. `batches` counts the encoding batches run so far.

    The worker is the only one to encode, so retrievers sharing one encoder with different modules
    (`serve --module-index`) are safe: it activates each module before encoding its queries."""

    def __init__(self, max_batch: int = 64, max_wait_ms: float = 5.0, precision: Precision = "float32"):
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError(f"max_batch {max_batch} must be >= 1 and max_wait_ms {max_wait_ms} >= 0")
        self.max_batch = max_batch
        self.precision = precision
        self.max_wait = max_wait_ms / 1000
        self.batches = 0
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task | None = None

    async def start(self) -> None:
        """Start the worker on the running event loop."""
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._work())

    async def stop(self) -> None:
        """Stop the worker once it has answered what is queued."""
        if self._worker is None or self._queue is None:
            return
        await self._queue.join()
        self._worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._worker
        self._worker = None

    async def search(
        self, retriever: Retriever, texts: list[str], k: int, domain: str | None = None
    ) -> list[list[Hit]]:
        """`retriever`'s hits for `texts` (of `domain`, for a fixed route), encoded together with whatever
        other requests are waiting."""
        if self._queue is None:
            raise RuntimeError("the batcher is not started")
        pending = _Pending(retriever, texts, k, asyncio.get_running_loop().create_future(), domain)
        await self._queue.put(pending)
        return await pending.done

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            size = len(batch[0].texts)
            deadline = time.monotonic() + self.max_wait
            while size < self.max_batch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    nxt = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
                batch.append(nxt)
                size += len(nxt.texts)
            try:
                results = await asyncio.to_thread(self._answer, batch)
                for pending, hits in zip(batch, results, strict=True):
                    if not pending.done.cancelled():
                        pending.done.set_result(hits)
            except Exception as err:  # every waiting request hears of the failure
                for pending in batch:
                    if not pending.done.done():
                        pending.done.set_exception(err)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _answer(self, batch: list[_Pending]) -> list[list[list[Hit]]]:
        answers: dict[int, list[list[Hit]]] = {}
        by_retriever: dict[int, list[int]] = {}
        for number, pending in enumerate(batch):
            by_retriever.setdefault(id(pending.retriever), []).append(number)
        for numbers in by_retriever.values():
            retriever = batch[numbers[0]].retriever
            retriever.encoder.activate(retriever.module)
            texts = [text for n in numbers for text in batch[n].texts]
            domains = None
            if retriever.route is not None and retriever.route.spec.type == "fixed":
                domains = [batch[n].domain for n in numbers for _ in batch[n].texts]
            vectors = retriever.encode_queries(
                texts, batch_size=max(len(texts), 1), precision=self.precision, domains=domains
            )
            self.batches += 1
            start = 0
            for n in numbers:
                size = len(batch[n].texts)
                answers[n] = retriever.hits(vectors[start : start + size], batch[n].k)
                start += size
        return [answers[n] for n in range(len(batch))]
