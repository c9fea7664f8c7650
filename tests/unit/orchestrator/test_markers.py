"""The run's markers on a real Redis stay bounded over a long run (bench/soak.py found the
`published` set growing by one member per prompt group, for the whole run), keep counting every
group published exactly once, and read a run written by the older one-set format."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from orchestrator.markers import STEPS_KEPT, RunMarkers
from searchr1.redis_retry import RedisRetry, connect

STEPS = 40
GROUPS = 3


@pytest.fixture
async def redis(redis_server):  # type: ignore[no-untyped-def]
    r = connect(redis_server.url)  # the client the services use
    yield r
    await r.aclose()


def markers(redis: aioredis.Redis) -> RunMarkers:
    return RunMarkers(redis, "t", RedisRetry("test", 5.0))


def gid(step: int, i: int) -> str:
    return f"run/{step}/p{i}"


async def keys(redis: aioredis.Redis) -> list[str]:
    return sorted([k.decode() async for k in redis.scan_iter(match="t:*")])


async def test_a_long_run_keeps_the_published_groups_of_its_last_steps_only(redis) -> None:  # type: ignore[no-untyped-def]
    m = markers(redis)
    await m.restore(0, {"run": 1})
    for step in range(STEPS):
        for i in range(GROUPS):
            await m.mark_published(step, gid(step, i))
            await m.mark_published(step, gid(step, i))  # a retried call counts once
        assert await m.published_count() == (step + 1) * GROUPS
    kept = range(STEPS - STEPS_KEPT, STEPS)
    assert await keys(redis) == sorted(
        ["t:base_version", "t:published:count", "t:record"] + [f"t:published:{s}" for s in kept]
    )
    for step in kept:
        assert await m.published(step, gid(step, 0))
        assert not await m.published(step, gid(step, GROUPS))


async def test_dynamic_sampling_slots_are_kept_for_the_last_steps_only(redis) -> None:  # type: ignore[no-untyped-def]
    m = markers(redis)
    for step in range(STEPS):
        assert await m.slot_limit(step, 2) == 2
        assert await m.take_slot(step, gid(step, 0), 2)
    kept = range(STEPS - STEPS_KEPT, STEPS)
    expected = [f"t:slot_limit:{s}" for s in kept] + [f"t:slots:{s}" for s in kept]
    assert await keys(redis) == sorted(expected)
    assert await m.slots_taken(STEPS - 1) == 1


async def test_a_run_in_the_old_one_set_format_resumes_with_its_count(redis) -> None:  # type: ignore[no-untyped-def]
    """Markers written before the per-step sets: one `published` set of every group."""
    old = [gid(s, i) for s in range(4) for i in range(GROUPS)]
    await redis.sadd("t:published", *old)
    m = markers(redis)
    await m.restore(0, {"run": 1})
    assert await m.published_count() == len(old)
    assert await m.published(3, gid(3, 0))
    await m.mark_published(3, gid(3, 0))  # already in the old set: not counted again
    await m.mark_published(4, gid(4, 0))
    assert await m.published_count() == len(old) + 1
    await m.restore(0, {"run": 1})  # a second restart does not reset the count
    assert await m.published_count() == len(old) + 1


async def test_forget_deletes_every_marker(redis) -> None:  # type: ignore[no-untyped-def]
    m = markers(redis)
    await redis.sadd("t:published", gid(0, 0))
    await m.restore(0, {"run": 1})
    await m.mark_published(1, gid(1, 0))
    await m.slot_limit(1, 2)
    await m.take_slot(1, gid(1, 0), 2)
    await m.save_step(2)
    await redis.set("other", "kept")
    await m.forget()
    assert await keys(redis) == []
    assert await redis.get("other") == b"kept"
