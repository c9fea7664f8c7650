"""The orchestrator's own Redis calls (its resume state) wait out a Redis restart instead of
killing the process with every in-flight sample; past `bus.reconnect_timeout_s` they raise."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from prometheus_client import REGISTRY

from searchr1.bus import TrajectoryBus
from searchr1.redis_server import RedisServer
from searchr1.sections import BusConfig
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_loop import build, drain
from tests.unit.orchestrator.test_rollout import TURN1, TURN2

T = TypeVar("T")


def retries(component: str) -> float:
    """All retries of one component, whatever the operation."""
    total = 0.0
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name == "searchr1_redis_retries_total" and s.labels["component"] == component:
                total += s.value
    return total


async def through_restart(
    server: RedisServer, call: Callable[[], Awaitable[T]], component: str = "orchestrator"
) -> T:
    """Stop Redis, start `call`, and once it is retrying start a new redis-server on the same
    port and data dir (AOF on): the call must then complete. A call that raises instead (no
    retry) surfaces its error here."""
    before = retries(component)
    server.stop()
    task = asyncio.ensure_future(call())
    while retries(component) == before and not task.done():
        await asyncio.sleep(0.01)
    await asyncio.to_thread(server.start)
    return await asyncio.wait_for(task, 60)


@pytest.fixture
async def bus(redis_server):  # type: ignore[no-untyped-def]
    b = TrajectoryBus.from_url(redis_server.url, BusConfig(reconnect_timeout_s=60))
    yield b
    await b.close()


async def test_state_calls_wait_out_a_redis_restart(tokenizer, bus, redis_server) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2], weight_version=3)
    orch = build(tokenizer, bus, engine, mode="async")
    await through_restart(redis_server, orch.restore)
    assert orch.base_version == 3 and orch.step == 0
    await through_restart(redis_server, lambda: orch.markers.mark_published(0, "run/0/p"))
    assert await through_restart(redis_server, lambda: orch.markers.published(0, "run/0/p"))
    assert await through_restart(redis_server, orch.markers.published_count) == 1
    # The data survived every restart (AOF): a second restore sees the same base version.
    engine.weight_version = 9
    await through_restart(redis_server, orch.restore)
    assert orch.base_version == 3


async def test_a_run_survives_redis_restarts_mid_step(tokenizer, bus, redis_server) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2])
    orch = build(tokenizer, bus, engine, mode="async", max_steps=2)
    real_publish, real_step = bus.publish, orch.run_step
    outages: list[asyncio.Task[Any]] = []

    def outage() -> None:
        """Redis goes down now and comes back once the orchestrator has retried."""
        before = retries("orchestrator")
        redis_server.stop()

        async def come_back() -> None:
            while retries("orchestrator") == before and not run.done():
                await asyncio.sleep(0.01)
            await asyncio.to_thread(redis_server.start)

        outages.append(asyncio.ensure_future(come_back()))

    async def publish_then_outage(trajs: list[Any]) -> list[str]:
        ids = await real_publish(trajs)
        if len(outages) == 0:
            outage()  # hits the marker of the group just published
        return ids

    async def step_then_outage(step: int, **kw: Any) -> dict[str, float]:
        out = await real_step(step, **kw)
        if step == 0:
            await outages[0]
            outage()  # hits the step counter
        return out

    bus.publish = publish_then_outage  # type: ignore[method-assign]
    orch.run_step = step_then_outage  # type: ignore[method-assign]
    run = asyncio.ensure_future(orch.run())
    await asyncio.wait_for(run, 60)
    await asyncio.gather(*outages)
    assert orch.step == 2
    assert await orch.markers.published_count() == 4
    got = await drain(bus)
    ids = [d.trajectory.trajectory_id for d in got]
    assert len(ids) == len(set(ids)) == 8  # every group once, none lost in the outages
    assert int(await bus.redis.get(f"{orch.prefix}:step")) == 2


async def test_past_the_deadline_the_error_is_raised(tokenizer, redis_server) -> None:  # type: ignore[no-untyped-def]
    bus = TrajectoryBus.from_url(redis_server.url, BusConfig(reconnect_timeout_s=0.3))
    orch = build(tokenizer, bus, ScriptedEngine(tokenizer, [TURN1, TURN2]))
    await orch.restore()
    redis_server.stop()
    before = retries("orchestrator")
    try:
        with pytest.raises(Exception, match="unreachable") as raised:
            await orch.markers.published_count()
        from searchr1.redis_retry import RedisUnavailable

        assert isinstance(raised.value, RedisUnavailable)
        assert "orchestrator" in str(raised.value) and "published_count" in str(raised.value)
        assert retries("orchestrator") > before  # it did retry before giving up
    finally:
        await bus.close()
