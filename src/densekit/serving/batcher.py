"""Gathering concurrent requests' texts into one encoding batch, so throughput grows with concurrency,
behind a bounded queue so that overload is refused at once rather than left to wait without end."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import faiss
import numpy as np
import torch

from densekit.device import Precision
from densekit.encoding.embed import embed_tokens
from densekit.errors import DensekitError, InputError, StateError
from densekit.models.config import TextSide
from densekit.retrieval.hit import Hit
from densekit.retrieval.retriever import Retriever

# What a request asks of its texts: hits ("search"), or their vectors as queries or as passages.
Job = Literal["search", "query", "passage"]
# Event-loop turns in a row that queue nothing new before the worker stops gathering, and the most it
# gathers for: enough for the requests whose bytes have arrived to be parsed and queued.
QUIET_TURNS = 3
GATHER_TURNS = 64


@dataclass(frozen=True)
class Embeddings:
    """The vectors of a request's texts, in order, and how many tokens they took."""

    vectors: np.ndarray
    tokens: int


class Overloaded(DensekitError):
    """The queue holds `queued` texts already: more would wait longer than the service answers in."""

    def __init__(self, queued: int, retry_after: int):
        super().__init__(f"the service is busy ({queued} texts queued): retry after {retry_after} s")
        self.retry_after = retry_after


class Unencodable(DensekitError, ValueError):
    """A request whose texts the model could not take (its tokenizer refused them), found when the
    request was encoded on its own after the batch it shared failed."""

    def __init__(self, reason: object):
        first_line = (str(reason).splitlines() or [type(reason).__name__])[0]
        super().__init__(f"the texts of this request could not be encoded: {first_line}")


class TimedOut(DensekitError):
    """A request waited past the service's request timeout; its texts were dropped if not yet encoded."""

    def __init__(self, timeout: float, retry_after: int):
        super().__init__(f"no answer within the service's request timeout of {timeout:g} s: retry later")
        self.retry_after = retry_after


@dataclass
class _Pending:
    retriever: Retriever
    texts: list[str]
    job: Job
    done: asyncio.Future = field(repr=False)
    k: int = 0
    domain: str | None = None


def default_workers(retriever: Retriever) -> int:
    """Encoding workers for a service over `retriever`: two for PyTorch on a CPU with two compute threads
    or more, so that one batch is encoded while the next is gathered (each on its share of the
    threads: `MicroBatcher`); one on a GPU, which one batch at a time fills, and for an ONNX runtime,
    whose own thread pool takes every core for each batch."""
    encoder = retriever.encoder
    on_cpu = encoder.device.type == "cpu" and encoder.runtime is None
    return 2 if on_cpu and torch.get_num_threads() >= 2 else 1


class _TokenizerLocks:
    """One lock per encoder, under which its texts are tokenized, one worker at a time: a fast tokenizer
    refuses a call ("Already borrowed") while another thread's call holds it with other settings
    (queries and passages are truncated to different lengths). Encoding needs no lock: each retriever
    passes its module down (`module=`), so workers encode with different modules of one encoder at once."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[int, threading.Lock] = {}

    def of(self, retriever: Retriever) -> threading.Lock:
        """The lock under which `retriever`'s encoder tokenizes."""
        with self._guard:
            return self._locks.setdefault(id(retriever.encoder), threading.Lock())


class MicroBatcher:
    """Queues each request's texts; a worker takes every request waiting when it is free (up to
    `max_batch` texts) and those still arriving (parsed and queued while it lets the event loop run a few
    turns), then, while the service is under concurrent load (its last batch held several requests),
    what else arrives within `max_wait_ms`; a client alone is not kept waiting. It encodes them together
    per module and job on one thread of its own, off the event loop, and answers every request from it,
    each text tokenized once (the vectors and an embedding's token count). The texts gathered are sorted by
    length and run through the model at most `encode_batch` at a time, so short queries cost little for
    sharing a batch with long ones: a plain BERT on a CPU computes only their tokens
    (`densekit.models.packed`), other models cut batches where padding would cost more than another pass
    (`densekit.inference.length_batches`).

    At most `max_queued` texts wait: a request that would pass that gets `Overloaded` at once, with a
    retry delay estimated from the recent encoding speed. A request not answered within `timeout`
    seconds gets `TimedOut`, and its texts are dropped unless already being encoded; so are those of a
    request whose client went away. `batches` counts the encoding batches run; `on_batch(texts,
    seconds)` hears of each. When encoding a batch of several requests fails, each is encoded again on
    its own, so that one request's text the tokenizer refuses fails that request only (`Unencodable`).

    With `workers` above one, as many batches are gathered and encoded at once, each on a thread of its
    own: a worker gathers at most its share of the texts in flight (so that at 32 requests in flight two
    batches of 16 alternate, one encoded while the other's answers are written and its next requests
    parsed); a batch of one request with no other being encoded (a client alone) runs on all `threads`
    compute threads, every other on its worker's share of them. Retrievers sharing one encoder with
    different modules (`serve --module-index`) are safe: each encodes with its own module, passed down,
    and tokenizes under its encoder's lock (`_TokenizerLocks`)."""

    def __init__(
        self,
        max_batch: int = 64,
        max_wait_ms: float = 5.0,
        precision: Precision = "float32",
        max_queued: int = 1024,
        timeout: float | None = None,
        on_batch: Callable[[int, float], None] | None = None,
        encode_batch: int = 32,
        workers: int = 1,
        threads: int | None = None,
    ):
        if min(max_batch, max_queued, encode_batch, workers, threads or 1) < 1 or max_wait_ms < 0:
            raise InputError(
                f"max_batch {max_batch}, max_queued {max_queued}, encode_batch {encode_batch}, workers "
                f"{workers} and threads {threads} must be >= 1, max_wait_ms {max_wait_ms} >= 0"
            )
        if timeout is not None and timeout <= 0:
            raise InputError(f"timeout {timeout} must be > 0 seconds")
        self.max_batch = max_batch
        self.encode_batch = encode_batch
        self.precision = precision
        self.max_wait = max_wait_ms / 1000
        self.max_queued = max_queued
        self.timeout = timeout
        self.on_batch = on_batch
        self.workers = workers
        self.threads = threads or torch.get_num_threads()
        self.batches = 0
        self.queued = 0  # texts waiting, not yet taken into a batch
        self.in_flight = 0  # texts of requests not yet answered, queued or being encoded
        self._seconds_per_text = 0.0  # a moving average over recent batches, for Retry-After
        self._queue: asyncio.Queue[_Pending] | None = None
        self._tasks: list[asyncio.Task] = []
        self._threads: list[ThreadPoolExecutor] = []
        self._busy = True  # whether the last batch held several requests (before the first: assumed)
        self._tokenizer_locks = _TokenizerLocks()
        self._counting = threading.Lock()
        self._encoding = 0  # batches being encoded now
        self._in_flight_seen: deque[int] = deque([0], maxlen=2 * workers)  # as the last batches were gathered

    async def start(self) -> None:
        """Start the workers on the running event loop, and the thread each encodes on."""
        self._queue = asyncio.Queue()
        # a thread per worker, always the same: the model's thread pool (OpenMP's) stays that of one caller
        self._threads = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"densekit-encode-{n}")
                         for n in range(self.workers)]  # fmt: skip
        self._tasks = [asyncio.create_task(self._work(thread)) for thread in self._threads]

    async def stop(self) -> None:
        """Stop the workers once they have answered what is queued."""
        if not self._tasks or self._queue is None:
            return
        await self._queue.join()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for thread in self._threads:
            thread.shutdown(wait=True)
        self._threads = []

    async def search(
        self, retriever: Retriever, texts: list[str], k: int, domain: str | None = None
    ) -> list[list[Hit]]:
        """`retriever`'s hits for `texts` (of `domain`, for a fixed route), encoded together with whatever
        other requests are waiting."""
        return await self._submit(retriever, texts, "search", k, domain)

    async def embed(
        self, retriever: Retriever, texts: list[str], side: TextSide, domain: str | None = None
    ) -> Embeddings:
        """The vectors `retriever` gives `texts` as queries (routed, with a route) or as passages."""
        return await self._submit(retriever, texts, side, 0, domain)

    def retry_after(self) -> int:
        """Seconds after which the queue as it is now should have drained (at least 1)."""
        return max(1, math.ceil(self.queued * self._seconds_per_text))

    async def _submit(self, retriever: Retriever, texts: list[str], job: Job, k: int, domain: str | None):
        if self._queue is None:
            raise StateError("the batcher is not started")
        if self.queued + len(texts) > self.max_queued:
            raise Overloaded(self.queued, self.retry_after())
        pending = _Pending(retriever, texts, job, asyncio.get_running_loop().create_future(), k, domain)
        self.queued += len(texts)
        self.in_flight += len(texts)
        self._queue.put_nowait(pending)
        try:
            return await asyncio.wait_for(pending.done, self.timeout)
        except TimeoutError:  # wait_for cancelled the future: the worker skips it if it has not begun
            raise TimedOut(self.timeout or 0.0, self.retry_after()) from None
        finally:
            self.in_flight -= len(texts)

    def _most(self) -> int:
        """The most texts a worker gathers now, within `max_batch`: its share of those in flight, now or
        when the last few batches were gathered (so that at 32 requests in flight two groups of 16
        alternate rather than splitting into ever smaller batches); all of them for a worker alone."""
        if self.workers == 1:
            return self.max_batch
        in_flight = max(self.in_flight, *self._in_flight_seen)
        return min(self.max_batch, max(1, math.ceil(in_flight / self.workers)))

    async def _work(self, thread: ThreadPoolExecutor) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._take()]
            size = await self._gather_arriving(batch)
            # a timed wait for company pays only under concurrent load: not for a client alone
            deadline = time.monotonic() + (self.max_wait if self._busy else 0.0)
            while size < self._most():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    nxt = await asyncio.wait_for(self._take(), remaining)
                except TimeoutError:
                    break
                batch.append(nxt)
                size += len(nxt.texts)
            self._busy = len(batch) > 1
            self._in_flight_seen.append(self.in_flight)
            live = [pending for pending in batch if not pending.done.done()]
            try:
                if live:
                    started = time.perf_counter()
                    outcomes = await loop.run_in_executor(thread, self._answer_on_share, live)
                    self._measured(sum(len(p.texts) for p in live), time.perf_counter() - started)
                    for pending, outcome in zip(live, outcomes, strict=True):
                        _settle(pending.done, outcome)
            except Exception as err:  # every waiting request hears of the failure
                for pending in live:
                    _settle(pending.done, err)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _gather_arriving(self, batch: list[_Pending]) -> int:
        """Add to `batch` what waited while the last batch ran, then what is still arriving: the event
        loop is let run a turn at a time (reading sockets, parsing requests) for as long as each turn
        queues more, so that concurrent requests share a batch without a timed wait for a lone one.
        Returns the texts in `batch`."""
        assert self._queue is not None
        size = sum(len(pending.texts) for pending in batch)
        quiet = turns = 0
        while size < self._most() and quiet < QUIET_TURNS and turns < GATHER_TURNS:
            if self._queue.empty():
                quiet += 1
                turns += 1
                await asyncio.sleep(0)
                continue
            batch.append(self._take_nowait())
            size += len(batch[-1].texts)
            quiet = 0
        return size

    async def _take(self) -> _Pending:
        assert self._queue is not None
        pending = await self._queue.get()
        self.queued -= len(pending.texts)
        return pending

    def _take_nowait(self) -> _Pending:
        assert self._queue is not None
        pending = self._queue.get_nowait()
        self.queued -= len(pending.texts)
        return pending

    def _measured(self, texts: int, seconds: float) -> None:
        per_text = seconds / max(texts, 1)
        previous = self._seconds_per_text
        self._seconds_per_text = per_text if previous == 0 else 0.8 * previous + 0.2 * per_text
        if self.on_batch is not None:
            self.on_batch(texts, seconds)

    def _answer_on_share(self, batch: list[_Pending]) -> list[object]:
        """`_answer_apart` on this worker's threads (the model's and the index's): all of them for a
        client alone (a batch of one request, no other batch being encoded), where they shorten its
        wait; its share under concurrent load, where a thread a batch costs less CPU than two (with one
        worker, the threads are left as they are)."""
        if self.workers == 1:
            return self._answer_apart(batch)
        with self._counting:
            self._encoding += 1
            alone = self._encoding == 1 and len(batch) == 1
        try:
            threads = self.threads if alone else max(1, self.threads // self.workers)
            torch.set_num_threads(threads)
            faiss.omp_set_num_threads(threads)
            return self._answer_apart(batch)
        finally:
            with self._counting:
                self._encoding -= 1

    def _answer_apart(self, batch: list[_Pending]) -> list[object]:
        """Each request's answer, from one encoding of them all, or, where that fails, from encoding
        each on its own: an exception for each request that fails alone."""
        try:
            return self._answer(batch)
        except Exception as err:
            if len(batch) == 1:
                return [_as_request_error(err)]
        outcomes: list[object] = []
        for pending in batch:
            try:
                outcomes.append(self._answer([pending])[0])
            except Exception as err:
                outcomes.append(_as_request_error(err))
        return outcomes

    def _answer(self, batch: list[_Pending]) -> list[list[list[Hit]] | Embeddings]:
        answers: dict[int, list[list[Hit]] | Embeddings] = {}
        groups: dict[tuple[int, Job], list[int]] = {}
        for number, pending in enumerate(batch):
            groups.setdefault((id(pending.retriever), pending.job), []).append(number)
        for (_, job), numbers in groups.items():
            retriever = batch[numbers[0]].retriever
            texts = [text for n in numbers for text in batch[n].texts]
            vectors, lengths = self._encode(retriever, job, texts, [batch[n] for n in numbers])
            with self._counting:
                self.batches += 1
            rows: dict[int, slice] = {}
            start = 0
            for n in numbers:
                rows[n] = slice(start, start + len(batch[n].texts))
                start = rows[n].stop
            if job == "search":
                answers |= _hits_by_k(retriever, vectors, {n: (rows[n], batch[n].k) for n in numbers})
            else:
                for n in numbers:
                    answers[n] = Embeddings(vectors[rows[n]], sum(lengths[rows[n]]))
        return [answers[n] for n in range(len(batch))]

    def _encode(
        self, retriever: Retriever, job: Job, texts: list[str], requests: list[_Pending]
    ) -> tuple[np.ndarray, list[int]]:
        """The vectors of `texts` and, for embeddings, the tokens each took (none for a search): the
        texts are tokenized once, for both."""
        routed = retriever.route is not None
        with self._tokenizer_locks.of(retriever):
            token_ids = retriever.encoder.tokenize(texts, "passage" if job == "passage" else "query")
        if job == "passage":  # a route's passages are the base's, as its index's are
            vectors = embed_tokens(retriever.encoder, token_ids, "passage", self.encode_batch, self.precision,
                                   module=retriever.module)  # fmt: skip
        else:
            domains = None
            if routed and retriever.route.strategy.takes_domains:  # type: ignore[union-attr]
                domains = [pending.domain for pending in requests for _ in pending.texts]
            vectors = retriever.encode_queries(texts, batch_size=self.encode_batch, precision=self.precision,
                                               domains=domains, token_ids=token_ids)  # fmt: skip
        if job == "search":
            return vectors, []
        return vectors, [len(ids) for ids in token_ids]


def _hits_by_k(retriever: Retriever, vectors: np.ndarray, wanted: dict[int, tuple[slice, int]]
               ) -> dict[int, list[list[Hit]]]:  # fmt: skip
    """Each request's hits (`wanted`: its rows of `vectors` and its k), from one search of the index
    per k asked for: a search's fixed cost (the index call, the document store's query) is paid once
    for the requests that share it."""
    by_k: dict[int, list[int]] = {}
    for n, (_, k) in wanted.items():
        by_k.setdefault(k, []).append(n)
    answers: dict[int, list[list[Hit]]] = {}
    for k, numbers in by_k.items():
        rows = np.concatenate([np.arange(wanted[n][0].start, wanted[n][0].stop) for n in numbers])
        found = retriever.hits(vectors[rows], k)
        start = 0
        for n in numbers:
            size = wanted[n][0].stop - wanted[n][0].start
            answers[n] = found[start : start + size]
            start += size
    return answers


def _as_request_error(err: Exception) -> Exception:
    """What a request hears of the exception its own texts raised: a tokenizer's refusal (a type, value
    or Unicode error) as `Unencodable`, anything else as it is."""
    if isinstance(err, TypeError | ValueError) and not isinstance(err, Unencodable):
        return Unencodable(err)
    return err


def _settle(done: asyncio.Future, outcome: object) -> None:
    """Answer a request with `outcome`, an exception or its result, unless it gave up already."""
    if done.done():
        return
    if isinstance(outcome, BaseException):
        done.set_exception(outcome)
    else:
        done.set_result(outcome)
