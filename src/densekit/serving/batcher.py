"""Gathering concurrent requests' queries into one encoding batch, so throughput grows with concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from densekit.retrieval.retriever import Hit, Retriever


@dataclass
class _Pending:
    texts: list[str]
    k: int
    done: asyncio.Future = field(repr=False)


class MicroBatcher:
    """Queues each request's queries; one worker takes the first waiting request, gathers what else
    arrives within `max_wait_ms` (up to `max_batch` queries), encodes them in one batch off the event
    loop, and answers every request from it. `batches` counts the encoding batches run so far."""

    def __init__(self, retriever: Retriever, max_batch: int = 64, max_wait_ms: float = 5.0):
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError(f"max_batch {max_batch} must be >= 1 and max_wait_ms {max_wait_ms} >= 0")
        self.retriever = retriever
        self.max_batch = max_batch
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

    async def search(self, texts: list[str], k: int) -> list[list[Hit]]:
        """Hits for `texts`, encoded together with whatever other requests are waiting."""
        if self._queue is None:
            raise RuntimeError("the batcher is not started")
        pending = _Pending(texts, k, asyncio.get_running_loop().create_future())
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
        texts = [text for pending in batch for text in pending.texts]
        vectors = self.retriever.encode_queries(texts, batch_size=max(len(texts), 1))
        self.batches += 1
        answers, start = [], 0
        for pending in batch:
            answers.append(self.retriever.hits(vectors[start : start + len(pending.texts)], pending.k))
            start += len(pending.texts)
        return answers
