from __future__ import annotations

import asyncio
import threading
import time

import pytest

from retriever.backends.base import InlinePath
from retriever.batcher import MicroBatcher, Overloaded
from retriever.config import BatchingConfig


class SlowEcho:
    """A stand-in search function: each query's hits encode the query, topk and batch number."""

    def __init__(self, delay_s: float = 0.02) -> None:
        self.delay_s = delay_s
        self.batch_sizes: list[int] = []
        self.threads: set[str] = set()

    def __call__(self, queries: list[str], topk: int):
        self.threads.add(threading.current_thread().name)
        self.batch_sizes.append(len(queries))
        time.sleep(self.delay_s)
        return [
            [({"id": f"{q}#{r}", "contents": q}, float(topk - r)) for r in range(topk)]
            for q in queries
        ]


async def test_concurrent_requests_each_get_their_own_answers_in_fewer_batches():
    fn = SlowEcho()
    b = MicroBatcher(fn, BatchingConfig(max_batch=16, max_wait_ms=0))
    try:

        async def one(i: int):
            topk = 1 + i % 4
            res = await b.submit([f"q{i}a", f"q{i}b"], topk)
            return i, topk, res

        outs = await asyncio.gather(*(one(i) for i in range(64)))
    finally:
        b.close()
    for i, topk, res in outs:
        assert [[d["id"] for d, _ in hits] for hits in res] == [
            [f"q{i}a#{r}" for r in range(topk)],
            [f"q{i}b#{r}" for r in range(topk)],
        ]
    assert sum(fn.batch_sizes) == 128
    assert max(fn.batch_sizes) <= 16
    assert len(fn.batch_sizes) < 64  # requests were batched together
    assert fn.threads == {"retriever-batcher"}  # never on the event loop thread


async def test_event_loop_stays_responsive_while_a_batch_computes():
    b = MicroBatcher(SlowEcho(delay_s=0.3), BatchingConfig(max_wait_ms=0))
    try:
        task = asyncio.create_task(b.submit(["x"], 1))
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        assert time.perf_counter() - t < 0.2
        await task
    finally:
        b.close()


async def test_overload_is_refused_not_queued():
    b = MicroBatcher(SlowEcho(delay_s=0.2), BatchingConfig(max_pending=3, max_wait_ms=0))
    try:
        first = asyncio.create_task(b.submit(["a"], 1))
        await asyncio.sleep(0.05)  # the worker took "a"; the queue is empty again
        queued = asyncio.create_task(b.submit(["b", "c", "d"], 1))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="max_pending=3"):
            await b.submit(["e"], 1)
        await first
        await queued
    finally:
        b.close()


async def test_backend_error_reaches_every_request_of_the_batch():
    def boom(queries, topk):
        raise RuntimeError("index exploded")

    b = MicroBatcher(boom, BatchingConfig())
    try:
        results = await asyncio.gather(
            b.submit(["a"], 1), b.submit(["b"], 1), return_exceptions=True
        )
    finally:
        b.close()
    assert all(isinstance(r, RuntimeError) for r in results)


async def test_pipeline_stages_overlap_and_keep_answers_apart():
    seen: list[tuple[str, float]] = []

    def encode(args):
        queries, topk = args
        seen.append(("encode", time.perf_counter()))
        time.sleep(0.05)
        return [q.upper() for q in queries], topk

    def search(args):
        upper, topk = args
        seen.append(("search", time.perf_counter()))
        time.sleep(0.05)
        return [[({"id": u, "contents": u}, 1.0)] * topk for u in upper]

    b = MicroBatcher([encode, search], BatchingConfig(max_batch=1, max_wait_ms=0))
    try:
        t = time.perf_counter()
        outs = await asyncio.gather(*(b.submit([f"q{i}"], 1 + i % 2) for i in range(6)))
        elapsed = time.perf_counter() - t
    finally:
        b.close()
    assert [[[d["id"] for d, _ in hits] for hits in res] for res in outs] == [
        [[f"Q{i}"] * (1 + i % 2)] for i in range(6)
    ]
    # 6 batches x 2 stages x 50 ms: 600 ms one after the other, ~350 ms overlapped.
    assert elapsed < 0.5
    assert b.stage_busy_s[0] > 0.25 and b.stage_busy_s[1] > 0.25


async def test_error_in_a_later_stage_reaches_the_requests():
    def search(args):
        raise ValueError("search stage failed")

    b = MicroBatcher([lambda args: args, search], BatchingConfig())
    try:
        with pytest.raises(ValueError, match="search stage failed"):
            await b.submit(["a"], 1)
        # The pipeline survives a failed batch.
        with pytest.raises(ValueError):
            await b.submit(["b"], 1)
    finally:
        b.close()


class Poisoned:
    """Echo search that blocks on "block" until `gate` is set and fails any batch holding
    "poison" (as a query the tokenizer chokes on fails a whole encode call)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.batches: list[list[str]] = []

    def __call__(self, queries: list[str], topk: int):
        self.batches.append(list(queries))
        if "block" in queries:
            self.gate.wait(5)
        if "poison" in queries:
            raise ValueError("cannot encode 'poison'")
        return [[({"id": q, "contents": q}, 1.0)] * topk for q in queries]


async def _poisoned_batch(b: MicroBatcher, fn: Poisoned) -> list:
    blocker = asyncio.create_task(b.submit(["block"], 1))
    await asyncio.sleep(0.05)  # the worker is inside the blocked batch
    # These queue up together behind it and form one batch.
    tasks = [asyncio.create_task(b.submit(qs, 1)) for qs in (["a"], ["b", "poison"], ["c", "d"])]
    await asyncio.sleep(0.05)
    fn.gate.set()
    await blocker
    return await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_failing_request_does_not_fail_the_others_in_its_batch():
    fn = Poisoned()
    b = MicroBatcher(fn, BatchingConfig(max_wait_ms=0))
    try:
        a, poisoned, cd = await _poisoned_batch(b, fn)
    finally:
        b.close()
    assert fn.batches[1] == ["a", "b", "poison", "c", "d"]  # they were batched together
    assert [[d["id"] for d, _ in hits] for hits in a] == [["a"]]
    assert [[d["id"] for d, _ in hits] for hits in cd] == [["c"], ["d"]]
    assert isinstance(poisoned, ValueError) and "poison" in str(poisoned)


async def test_a_failing_request_in_a_later_stage_does_not_fail_the_others():
    fn = Poisoned()

    def encode(args):
        queries, topk = args
        if "block" in queries:
            fn.gate.wait(5)
        return queries, topk

    b = MicroBatcher([encode, lambda args: fn(*args)], BatchingConfig(max_wait_ms=0))
    try:
        a, poisoned, cd = await _poisoned_batch(b, fn)
    finally:
        b.close()
    assert [[d["id"] for d, _ in hits] for hits in a] == [["a"]]
    assert [[d["id"] for d, _ in hits] for hits in cd] == [["c"], ["d"]]
    assert isinstance(poisoned, ValueError)


class Pipeline:
    """Two stages (echo encode, then search) and an inline path computing the same answers;
    records which way each batch went. Stage 0 blocks on a batch holding "block"."""

    def __init__(self, search_delay_s: float = 0.05) -> None:
        self.gate = threading.Event()
        self.search_delay_s = search_delay_s
        self.encoded: list[list[str]] = []
        self.inline: list[list[str]] = []
        self.inline_threads: set[str] = set()

    @staticmethod
    def hits(queries: list[str], topk: int):
        return [
            [({"id": f"{q}#{r}", "contents": q}, float(-r)) for r in range(topk)] for q in queries
        ]

    def encode(self, args):
        queries, topk = args
        self.encoded.append(list(queries))
        if "block" in queries:
            self.gate.wait(5)
        return queries, topk

    def search(self, args):
        time.sleep(self.search_delay_s)
        return self.hits(*args)

    def search_inline(self, queries: list[str], topk: int):
        self.inline.append(list(queries))
        self.inline_threads.add(threading.current_thread().name)
        return self.hits(queries, topk)

    def batcher(self, max_queries: int = 1, **cfg) -> MicroBatcher:
        return MicroBatcher(
            [self.encode, self.search],
            BatchingConfig(max_wait_ms=0, **cfg),
            inline=InlinePath(self.search_inline, max_queries=max_queries),
        )


async def test_a_lone_small_request_is_searched_inline_on_the_batching_thread():
    p = Pipeline()
    b = p.batcher(max_queries=1)
    try:
        res = await b.submit(["a"], 2)
        res2 = await b.submit(["b"], 1)
        big = await b.submit(["c", "d"], 1)  # more queries than max_queries: the pipeline
    finally:
        b.close()
    assert res == Pipeline.hits(["a"], 2) and res2 == Pipeline.hits(["b"], 1)
    assert big == Pipeline.hits(["c", "d"], 1)
    assert p.inline == [["a"], ["b"]]
    assert p.encoded == [["c", "d"]]
    assert p.inline_threads == {"retriever-batcher"}
    assert b.inline_batches == 2 and b.batches == 3


async def test_queued_or_in_flight_work_keeps_small_batches_in_the_pipeline():
    p = Pipeline(search_delay_s=0.2)
    b = p.batcher(max_queries=1, max_batch=1)
    try:
        blocker = asyncio.create_task(b.submit(["block", "x"], 1))
        await asyncio.sleep(0.05)  # stage 0 holds the blocker
        queued = [asyncio.create_task(b.submit([q], 1)) for q in ("a", "b")]
        await asyncio.sleep(0.05)
        p.gate.set()
        # "a" is taken while "b" waits; "b" while "a" is still being searched.
        outs = await asyncio.gather(blocker, *queued)
        lone = await b.submit(["c"], 1)  # the pipeline is idle again: inline
    finally:
        b.close()
    assert outs == [
        Pipeline.hits(["block", "x"], 1),
        Pipeline.hits(["a"], 1),
        Pipeline.hits(["b"], 1),
    ]
    assert p.encoded == [["block", "x"], ["a"], ["b"]]
    assert p.inline == [["c"]] and lone == Pipeline.hits(["c"], 1)


async def test_a_failing_inline_search_reaches_its_request_and_the_next_one_is_served():
    p = Pipeline()

    def failing(queries, topk):
        if "poison" in queries:
            raise ValueError("cannot encode 'poison'")
        return p.search_inline(queries, topk)

    b = MicroBatcher(
        [p.encode, p.search], BatchingConfig(max_wait_ms=0), inline=InlinePath(failing, 1)
    )
    try:
        with pytest.raises(ValueError, match="poison"):
            await b.submit(["poison"], 1)
        assert await b.submit(["ok"], 1) == Pipeline.hits(["ok"], 1)
    finally:
        b.close()


async def test_a_lone_query_right_after_an_answer_finds_the_pipeline_idle():
    """The last stage counts its batch out before answering: a client that sends its next
    query at once (concurrency 1) finds nothing in flight even if the search thread is
    preempted right after the answer (a busy machine; CI once failed the test above so)."""
    p = Pipeline()
    b = p.batcher(max_queries=1, max_batch=1)
    answer = b._deliver

    def preempted_after_answering(*args):  # type: ignore[no-untyped-def]
        answer(*args)
        time.sleep(0.3)

    b._deliver = preempted_after_answering  # type: ignore[method-assign]
    try:
        p.gate.set()
        first = await b.submit(["a", "b"], 1)  # two queries: not inline, through the stages
        lone = await b.submit(["c"], 1)
    finally:
        b.close()
    assert first == Pipeline.hits(["a", "b"], 1) and lone == Pipeline.hits(["c"], 1)
    assert p.inline == [["c"]]
