"""Cross-request micro-batching: queries from all in-flight requests are searched together.

Requests enqueue (queries, topk, future) and await the future; the first worker thread pops
everything queued (up to `max_batch` queries), optionally waits `max_wait_ms` for more, and runs
the backend once for the whole batch with the largest topk; each request's future gets its own
slice. The event loop never runs encoding or search. While a batch computes, new requests pile
up and form the next batch, so batches grow with load without any waiting.

A backend may split its work into stages (dense: encode, then search + row lookup); each stage
runs on its own thread with a small bounded hand-off queue between them, so batch N+1 is encoded
while batch N is searched (infinity-style overlap), and throughput is that of the slowest stage
rather than the sum. Past `max_pending` queued queries, `submit` raises Overloaded (HTTP 429)
instead of queueing forever.

A small batch (`InlinePath.max_queries`, one query by default) that finds the pipeline idle,
with nothing queued behind it and nothing in a later stage, is searched by the backend's inline
path on the batching thread itself: at low concurrency each hand-off between threads (and, for
dense, the round trip to the encoder child process) is latency nobody overlaps. As soon as work
queues up, batches take the pipeline again.

A batch that fails is not the fault of every request in it (one query a tokenizer chokes on
fails the whole encode call): its requests go back to the first stage, ahead of new work, and
each is retried in a batch of its own, so only the request that caused the error gets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge, Histogram

from retriever.backends.base import Hit, InlinePath, Overloaded
from retriever.config import BatchingConfig

log = logging.getLogger(__name__)

BATCH_QUERIES = Histogram(
    "searchr1_retriever_batch_queries",
    "Queries per backend batch (cross-request batching)",
    buckets=(1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 512),
)
BATCH_SECONDS = Histogram(
    "searchr1_retriever_batch_seconds",
    "Backend time per batch and pipeline stage (0, 1, ...; inline: a lone small batch)",
    ["stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
QUEUED_QUERIES = Gauge("searchr1_retriever_queued_queries", "Queries waiting for a batch")

# A stage maps its input to its output; the first gets (queries, topk), the last returns one
# hit list per query. One function = a one-stage pipeline.
Stage = Callable[[Any], Any]
SearchFn = Callable[[list[str], int], list[list[Hit]]]

# Batches in flight between two stages: enough to overlap, small enough to bound latency.
_HANDOFF_DEPTH = 2


@dataclass
class _Work:
    queries: list[str]
    topk: int
    future: asyncio.Future[list[list[Hit]]]
    loop: asyncio.AbstractEventLoop


class _Wake:
    """Queued to wake the first stage when failed requests wait to be retried alone."""


_WAKE = _Wake()


class MicroBatcher:
    def __init__(
        self,
        stages: SearchFn | Sequence[Stage],
        cfg: BatchingConfig,
        *,
        inline: InlinePath | None = None,
    ) -> None:
        if callable(stages):
            fn = stages
            stages = [lambda args: fn(*args)]
        self._stages = list(stages)
        self.cfg = cfg
        self._queue: queue.Queue[_Work | _Wake | None] = queue.Queue()
        self._pending = 0  # queued queries; updated under _lock from several threads
        self._lock = threading.Lock()
        # Requests of a failed batch, each to be searched alone (under _lock); once the first
        # stage has stopped, failures are delivered as they are.
        self._retry: deque[_Work] = deque()
        self._stopped = False
        self._inline = inline
        self._in_flight = 0  # batches past the first stage, not yet delivered (under _lock)
        self.batches = 0
        self.batched_queries = 0
        self.inline_batches = 0
        # Seconds each stage spent working: busy / wall time = that stage's utilisation.
        self.stage_busy_s = [0.0] * len(self._stages)
        self._handoffs: list[queue.Queue[tuple[list[_Work], Any, BaseException | None] | None]] = [
            queue.Queue(maxsize=_HANDOFF_DEPTH) for _ in self._stages[1:]
        ]
        self._threads = [
            threading.Thread(target=self._run_first, name="retriever-batcher", daemon=True)
        ] + [
            threading.Thread(
                target=self._run_stage, args=(i,), name=f"retriever-stage{i}", daemon=True
            )
            for i in range(1, len(self._stages))
        ]
        for t in self._threads:
            t.start()

    @property
    def busy_s(self) -> float:
        return max(self.stage_busy_s)

    async def submit(self, queries: list[str], topk: int) -> list[list[Hit]]:
        with self._lock:
            if self._pending + len(queries) > self.cfg.max_pending:
                raise Overloaded(
                    f"{self._pending} queries already queued (batching.max_pending="
                    f"{self.cfg.max_pending}); retry later"
                )
            self._pending += len(queries)
            QUEUED_QUERIES.set(self._pending)
        loop = asyncio.get_running_loop()
        work = _Work(queries, topk, loop.create_future(), loop)
        self._queue.put(work)
        return await work.future

    def close(self) -> None:
        self._queue.put(None)  # each thread passes the sentinel on, then exits
        for t in self._threads:
            t.join(timeout=30)

    # --- worker threads ------------------------------------------------------------------

    def _take_batch(self, first: _Work) -> tuple[list[_Work], bool]:
        """Gather queued work up to max_batch queries; returns (batch, stop_requested)."""
        batch, n = [first], len(first.queries)
        deadline = time.monotonic() + self.cfg.max_wait_ms / 1000.0
        while n < self.cfg.max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
            if item is None:
                return batch, True
            if isinstance(item, _Wake):
                continue
            batch.append(item)
            n += len(item.queries)
        return batch, False

    def _apply(self, i: int, batch: list[_Work], value: Any) -> tuple[Any, BaseException | None]:
        start = time.perf_counter()
        try:
            out, err = self._stages[i](value), None
        except Exception as e:  # delivered to every request of the batch
            out, err = None, e
            log.exception("batch search failed", extra={"stage": i, "requests": len(batch)})
        took = time.perf_counter() - start
        BATCH_SECONDS.labels(str(i)).observe(took)
        self.stage_busy_s[i] += took
        return out, err

    def _forward(self, i: int, batch: list[_Work], value: Any, err: BaseException | None) -> None:
        """Hand stage i's output to stage i+1, or resolve the requests after the last stage."""
        if i + 1 < len(self._stages):
            if i == 0:
                with self._lock:
                    self._in_flight += 1
            self._handoffs[i].put((batch, value, err))
        else:
            if i > 0:  # before the answer: a client's next lone query must find it idle
                with self._lock:
                    self._in_flight -= 1
            self._deliver(batch, value, err)

    def _next_retry(self) -> _Work | None:
        with self._lock:
            return self._retry.popleft() if self._retry else None

    def _run_first(self) -> None:
        stop = False
        while not stop:
            retry = self._next_retry()
            if retry is not None:  # already counted out of _pending
                batch, queries = [retry], retry.queries
            else:
                first = self._queue.get()
                if first is None:
                    break
                if isinstance(first, _Wake):
                    continue
                batch, stop = self._take_batch(first)
                queries = [q for w in batch for q in w.queries]
                with self._lock:
                    self._pending -= len(queries)
                    QUEUED_QUERIES.set(self._pending)
            BATCH_QUERIES.observe(len(queries))
            self.batches += 1
            self.batched_queries += len(queries)
            topk = max(w.topk for w in batch)
            if self._idle_for(len(queries)):
                self._run_inline(batch, queries, topk)
                continue
            value, err = self._apply(0, batch, (queries, topk))
            self._forward(0, batch, value, err)
        with self._lock:
            self._stopped = True
            left = list(self._retry)
            self._retry.clear()
        for w in left:
            self._deliver([w], None, RuntimeError("retriever shutting down"))
        if self._handoffs:
            self._handoffs[0].put(None)

    def _idle_for(self, n_queries: int) -> bool:
        """Whether a batch of n_queries takes the inline path: small, and nothing waits."""
        if self._inline is None or n_queries > self._inline.max_queries:
            return False
        with self._lock:
            return self._in_flight == 0 and not self._retry and self._queue.empty()

    def _run_inline(self, batch: list[_Work], queries: list[str], topk: int) -> None:
        assert self._inline is not None
        start = time.perf_counter()
        try:
            out, err = self._inline.search(queries, topk), None
        except Exception as e:
            out, err = None, e
            log.exception("inline search failed", extra={"requests": len(batch)})
        took = time.perf_counter() - start
        BATCH_SECONDS.labels("inline").observe(took)
        self.stage_busy_s[0] += took
        self.inline_batches += 1
        self._deliver(batch, out, err)

    def _run_stage(self, i: int) -> None:
        while (item := self._handoffs[i - 1].get()) is not None:
            batch, value, err = item
            if err is None:
                value, err = self._apply(i, batch, value)
            self._forward(i, batch, value, err)
        if i < len(self._handoffs):
            self._handoffs[i].put(None)

    def _retry_alone(self, batch: list[_Work]) -> bool:
        """Queue a failed batch's requests to be searched one by one; False once stopped."""
        with self._lock:
            if self._stopped:
                return False
            self._retry.extend(batch)
        self._queue.put(_WAKE)
        return True

    def _deliver(self, batch: list[_Work], results: Any, err: BaseException | None) -> None:
        if err is not None and len(batch) > 1 and self._retry_alone(batch):
            log.warning("retrying a failed batch request by request", extra={"n": len(batch)})
            return
        offset = 0
        for w in batch:
            mine = None
            if err is None:
                mine = [hits[: w.topk] for hits in results[offset : offset + len(w.queries)]]
            offset += len(w.queries)
            # RuntimeError: that request's event loop is closed, nobody waits for it.
            with contextlib.suppress(RuntimeError):
                w.loop.call_soon_threadsafe(_resolve, w.future, mine, err)


def _resolve(
    fut: asyncio.Future[list[list[Hit]]], result: list[list[Hit]] | None, err: BaseException | None
) -> None:
    if fut.done():  # the request was cancelled (client went away)
        return
    if err is not None:
        fut.set_exception(err)
    else:
        assert result is not None
        fut.set_result(result)
