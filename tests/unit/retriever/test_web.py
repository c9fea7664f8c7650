from __future__ import annotations

import asyncio
import time

import pytest

from harness.retriever_server import FakeSerper
from retriever.backends.base import BackendUnavailable
from retriever.backends.web import RateLimiter, WebBackend, to_hits
from retriever.config import SerperConfig


@pytest.fixture(scope="module")
def serper():
    with FakeSerper() as fake:
        yield fake


@pytest.fixture
def fake(serper):
    serper.fail_with.clear()
    serper.arrivals.clear()
    serper.bodies.clear()
    return serper


def cfg(fake: FakeSerper, **kw) -> SerperConfig:
    base = {"url": fake.url, "rate_limit_qps": 1000.0, "backoff_s": 0.01, "timeout_s": 5.0}
    return SerperConfig(**(base | kw))


def test_to_hits_snippet_only_contents_and_reciprocal_rank_scores():
    payload = {"organic": [{"title": " T ", "snippet": "S", "link": "L"}, {"title": "U"}]}
    assert to_hits(payload, 5) == [
        ({"id": "L", "contents": '"T"\nS'}, 1.0),
        ({"id": "2", "contents": '"U"\n'}, 0.5),
    ]
    assert to_hits({}, 3) == []


async def test_search_sends_serper_schema_and_returns_corpus_format(fake):
    web = WebBackend(cfg(fake), api_key="test-key")
    try:
        res = await web.search(["capital of france", "rome"], 2)
    finally:
        await web.aclose()
    assert [len(r) for r in res] == [2, 2]
    doc, score = res[0][0]
    assert doc["contents"] == '"capital of france title 1"\nsnippet 1 about capital of france'
    assert score == 1.0
    assert {"q": "rome", "num": 2, "gl": "us", "hl": "en"} in fake.bodies


async def test_retries_5xx_and_429_then_succeeds(fake):
    fake.fail_with[:] = [500, 429]
    web = WebBackend(cfg(fake, max_retries=2), api_key="test-key")
    try:
        res = await web.search(["q"], 1)
    finally:
        await web.aclose()
    assert len(res[0]) == 1
    assert len(fake.arrivals) == 3


async def test_exhausted_retries_raise_unavailable_never_empty(fake):
    fake.fail_with[:] = [503, 503, 503]
    web = WebBackend(cfg(fake, max_retries=2), api_key="test-key")
    try:
        with pytest.raises(BackendUnavailable, match="after 3 attempts"):
            await web.search(["q"], 1)
    finally:
        await web.aclose()


async def test_wrong_key_is_not_retried(fake):
    web = WebBackend(cfg(fake, max_retries=3), api_key="wrong")
    try:
        with pytest.raises(BackendUnavailable, match="HTTP 403"):
            await web.search(["q"], 1)
    finally:
        await web.aclose()
    assert len(fake.arrivals) == 1


async def test_connection_refused_is_unavailable():
    from searchr1.redis_server import free_port

    c = SerperConfig(url=f"http://127.0.0.1:{free_port()}/search", max_retries=1, backoff_s=0.01)
    web = WebBackend(c, api_key="k")
    try:
        with pytest.raises(BackendUnavailable, match="ConnectError"):
            await web.search(["q"], 1)
    finally:
        await web.aclose()


async def test_client_side_rate_limit_spaces_requests(fake):
    web = WebBackend(cfg(fake, rate_limit_qps=20.0), api_key="test-key")
    start = time.monotonic()
    try:
        await web.search([f"q{i}" for i in range(6)], 1)
    finally:
        await web.aclose()
    # 6 requests at 20/s: the last cannot be sent before 5 intervals of 50 ms. A lower bound
    # only (gaps between arrivals jitter with the machine's load; slowness cannot break it).
    assert len(fake.arrivals) == 6 and fake.arrivals[-1] - start >= 0.25 - 1e-3


async def test_rate_limiter_hand_computed():
    lim = RateLimiter(10.0)
    t = time.monotonic()
    await asyncio.gather(*(lim.acquire() for _ in range(4)))
    assert time.monotonic() - t >= 0.3 - 1e-3  # waits 0, 0.1, 0.2, 0.3 s


def test_missing_key_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    with pytest.raises(ValueError, match="SERPER_API_KEY"):
        WebBackend(SerperConfig())


async def test_the_queue_is_bounded(fake):
    """Queries waiting behind the rate limiter used to queue without bound."""
    from retriever.backends.base import Overloaded

    web = WebBackend(cfg(fake, rate_limit_qps=5.0, max_queued=4), api_key="test-key")
    try:
        first = asyncio.create_task(web.search([f"a{i}" for i in range(3)], 1))
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded, match=r"retriever\.serper\.max_queued"):
            await web.search(["b0", "b1"], 1)  # 3 + 2 > 4
        assert len(await first) == 3
        assert len(await web.search(["c0"], 1)) == 1  # the queue drained: accepted again
    finally:
        await web.aclose()


async def test_abandoned_searches_stop_spending_the_api_key(fake):
    web = WebBackend(cfg(fake, rate_limit_qps=4.0), api_key="test-key")
    try:
        task = asyncio.create_task(web.search([f"q{i}" for i in range(8)], 1))
        await asyncio.sleep(0.3)
        task.cancel()  # the client went away (the server cancels its handler)
        with pytest.raises(asyncio.CancelledError):
            await task
        sent = len(fake.arrivals)
        await asyncio.sleep(1.0)  # 8 queries at 4/s would take 2 s
        assert len(fake.arrivals) == sent < 8
        assert web.queued == 0
    finally:
        await web.aclose()
