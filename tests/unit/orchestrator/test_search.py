"""Search retries, timeouts, the concurrency cap, and the explicit failure observation."""

from __future__ import annotations

import asyncio

from orchestrator import metrics
from orchestrator.config import RolloutConfig, SearchConfig
from orchestrator.prompt import prompt_token_ids
from orchestrator.rollout import Rollout
from orchestrator.sample import new_group
from orchestrator.tools.search import SearchTool
from retriever.client import RetrieverBadRequest, RetrieverUnavailable, SearchHit
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_rollout import PROMPT, TURN1, TURN2

FAST = {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}
HIT = SearchHit("1", '"T"\nbody', 1.0)


class Flaky:
    """Fails `failures` times with `exc`, then answers; or sleeps `delay` per call. Its
    /ready is fine throughout (a retriever that is up but fails searches)."""

    def __init__(self, failures: int, exc: Exception | None = None, delay: float = 0.0) -> None:
        self.failures, self.exc, self.delay = failures, exc, delay
        self.calls = 0
        self.in_flight = self.max_in_flight = 0

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[SearchHit]]:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.calls <= self.failures:
                raise self.exc or RetrieverUnavailable("HTTP 503: warming up")
            return [[HIT] for _ in queries]
        finally:
            self.in_flight -= 1

    async def ready(self) -> bool:
        return True


async def test_retries_then_recovers() -> None:
    client = Flaky(2)
    out = await SearchTool(client, SearchConfig(limits=dict(max_attempts=3, **FAST))).search("q")
    assert out.error == "" and out.attempts == 3 and [d.id for d in out.docs] == ["1"]


async def test_exhausted_retries_are_explicit_and_counted() -> None:
    before = metrics.SEARCH_FAILURES.labels("RetrieverUnavailable")._value.get()
    client = Flaky(10)
    out = await SearchTool(client, SearchConfig(limits=dict(max_attempts=3, **FAST))).search("q")
    assert client.calls == 3 and out.attempts == 3
    assert "RetrieverUnavailable" in out.error and not out.docs
    assert metrics.SEARCH_FAILURES.labels("RetrieverUnavailable")._value.get() == before + 1


async def test_bad_request_is_not_retried() -> None:
    client = Flaky(10, exc=RetrieverBadRequest("HTTP 400: topk"))
    out = await SearchTool(client, SearchConfig(limits=dict(max_attempts=5, **FAST))).search("q")
    assert client.calls == 1 and "HTTP 400" in out.error


async def test_timeout_per_attempt() -> None:
    client = Flaky(0, delay=0.5)
    out = await SearchTool(
        client, SearchConfig(limits=dict(timeout_s=0.05, max_attempts=2, **FAST))
    ).search("q")
    assert out.attempts == 2 and out.error == "timed out after 0.05s"
    assert out.latency_s < 0.4


async def test_global_concurrency_cap() -> None:
    client = Flaky(0, delay=0.02)
    tool = SearchTool(client, SearchConfig(limits=dict(max_concurrency=3)))
    await asyncio.gather(*(tool.search(f"q{i}") for i in range(12)))
    assert client.max_in_flight == 3


async def test_failure_observation_reaches_policy_and_turn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tool = SearchTool(Flaky(100), SearchConfig(limits=dict(max_attempts=2, **FAST)))
    rollout = Rollout(RolloutConfig(), ScriptedEngine(tokenizer, [TURN1, TURN2]), tool, tokenizer)
    [s] = new_group(
        PROMPT,
        prompt_token_ids(tokenizer, PROMPT.messages),
        group_size=1,
        rollout_step=0,
        run_id="r",
    )
    await rollout.run_sample(s)
    assert s.turns[0].error.startswith("RetrieverUnavailable")
    assert s.turns[0].tool_attempts == 2
    assert "<information>Search failed: RetrieverUnavailable: HTTP 503: warming up." in (
        s.response_text
    )
    assert s.status.value == "answered"


class Outage(Flaky):
    """Down (every search fails, /ready false) until `up()`; its /health answers throughout,
    as a restarted retriever's does while it loads its index."""

    def __init__(self) -> None:
        super().__init__(failures=10**9)
        self.loaded = False
        self.ready_calls = 0

    def up(self) -> None:
        self.failures, self.loaded = self.calls, True

    async def health(self) -> bool:
        return True

    async def ready(self) -> bool:
        self.ready_calls += 1
        return self.loaded


async def test_an_outage_opens_the_breaker_and_searches_wait_for_the_retriever() -> None:
    """A retriever outage used to become training data: every sample got a failure
    observation. Then searches in flight when it went down still failed (bench/chaos.py: a
    30 s outage cost 30 of a step's 32 samples, flagged and left out of the loss). Now every
    search, in flight or new, waits for the retriever and tries again once it is back: when
    its /ready answers, not its /health (a restarted retriever loads its index after its port
    opens; closed on /health, the breaker let searches fail again)."""
    client = Outage()
    tool = SearchTool(
        client,
        SearchConfig(limits=dict(max_attempts=2, breaker_failures=3, breaker_probe_s=0.01, **FAST)),
    )
    in_flight = [asyncio.create_task(tool.search(f"q{i}")) for i in range(5)]
    await asyncio.sleep(0.1)
    assert not any(t.done() for t in in_flight)
    assert tool.breaker_open and metrics.RETRIEVER_BREAKER_OPEN._value.get() == 1
    calls = client.calls
    new = asyncio.create_task(tool.search("q"))
    await asyncio.sleep(0.1)
    assert not new.done() and client.calls == calls  # all wait; no search is attempted
    client.up()
    for out in await asyncio.wait_for(asyncio.gather(*in_flight, new), 5):
        assert out.error == "" and [d.id for d in out.docs] == ["1"]
    assert not tool.breaker_open and metrics.RETRIEVER_BREAKER_OPEN._value.get() == 0


class SlowReadyOutage(Outage):
    """An outage whose /ready takes a while to fail (a retriever host not answering)."""

    async def ready(self) -> bool:
        self.ready_calls += 1
        await asyncio.sleep(0.05)
        return self.loaded


async def test_searches_exhausted_together_share_one_ready_probe() -> None:
    """Searches in flight when the retriever goes down run out of retries at about the same
    moment; each probed /ready on its own (up to `max_concurrency` probes at a retriever that
    is already struggling). They now share the one probe in flight."""
    client = SlowReadyOutage()
    tool = SearchTool(
        client,
        SearchConfig(limits=dict(max_attempts=1, breaker_failures=100, breaker_probe_s=10, **FAST)),
    )
    waiting = [asyncio.create_task(tool.search(f"q{i}")) for i in range(50)]
    # polled, not a fixed sleep: on a loaded CI machine 50 searches took longer than 0.2 s to
    # run out of retries; once open (on a failed probe) the breaker keeps the next probe 10 s off
    for _ in range(500):
        if tool.breaker_open:
            break
        await asyncio.sleep(0.01)
    assert tool.breaker_open and client.ready_calls == 1
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_searches_failing_on_a_ready_retriever_fail_and_open_the_breaker() -> None:
    """/ready fine but every search fails: the searches fail (no endless wait), and
    `breaker_failures` of them in a row still open the breaker."""
    tool = SearchTool(
        Flaky(10**9),
        SearchConfig(limits=dict(max_attempts=1, breaker_failures=2, breaker_probe_s=5, **FAST)),
    )
    for _ in range(2):
        assert "RetrieverUnavailable" in (await tool.search("q")).error
    assert tool.breaker_open


async def test_a_search_waits_at_most_breaker_max_wait_s() -> None:
    client = Outage()
    tool = SearchTool(
        client,
        SearchConfig(
            limits=dict(
                max_attempts=1, breaker_failures=1, breaker_probe_s=0.01, breaker_max_wait_s=0.2,
                **FAST,
            )
        ),
    )  # fmt: skip
    out = await tool.search("q")
    assert "retriever down for more than 0.2s" in out.error and client.ready_calls > 0
    assert 0.2 <= out.latency_s < 2


async def test_a_failed_search_flags_the_sample_as_an_infrastructure_failure(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from orchestrator.trajectory import to_trajectory

    engine = ScriptedEngine(tokenizer, [TURN1, TURN2])
    tool = SearchTool(
        Flaky(10**9), SearchConfig(limits=dict(max_attempts=1, breaker_failures=99, **FAST))
    )
    rollout = Rollout(RolloutConfig(), engine, tool, tokenizer)
    ids = prompt_token_ids(tokenizer, PROMPT.messages)
    [s] = new_group(PROMPT, ids, group_size=1, rollout_step=0, run_id="r")
    await rollout.run_sample(s)
    assert s.infrastructure_failure and to_trajectory(s).infrastructure_failure
