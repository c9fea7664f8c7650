"""Step claims on a real Redis: several workers share a step, a dead worker's groups are taken
over, a stalled worker stops a group it lost, a stopped worker hands its groups back."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import redis.asyncio as aioredis

from orchestrator.config import PartitionConfig
from orchestrator.markers import STEPS_KEPT
from orchestrator.partition import CLAIMS_LOST, RECLAIMED, StepClaims
from searchr1.redis_retry import RedisRetry, connect

IDS = [f"run/0/p{i}" for i in range(12)]


@pytest.fixture
async def redis(redis_server):  # type: ignore[no-untyped-def]
    r = connect(redis_server.url)  # the client the services use
    yield r
    await r.aclose()


def claims(redis: aioredis.Redis, worker: str, ttl: float = 5.0, max_groups: int = 2) -> StepClaims:
    cfg = PartitionConfig(worker_id=worker, claim_ttl_s=ttl, poll_s=0.02)
    return StepClaims(redis, "t", cfg, RedisRetry("test", 5.0), max_groups=max_groups)


async def test_three_workers_share_a_step_without_running_a_group_twice(redis) -> None:  # type: ignore[no-untyped-def]
    runs: Counter[str] = Counter()
    by_worker: dict[str, list[str]] = {}

    def runner(worker: str):  # type: ignore[no-untyped-def]
        async def run(gid: str) -> str:
            runs[gid] += 1
            by_worker.setdefault(worker, []).append(gid)
            await asyncio.sleep(0.01)
            return gid

        return run

    workers = [claims(redis, f"w{i}") for i in range(3)]
    results = await asyncio.wait_for(
        asyncio.gather(*(w.run_step(0, IDS, runner(w.worker)) for w in workers)), 20
    )
    assert sorted(g for r in results for g in r) == sorted(IDS)
    assert set(runs.values()) == {1}
    assert len(by_worker) == 3  # each had room for 2 of 12: all took part
    assert await workers[0].done(0)
    # A process joining the finished step has nothing to do.
    assert await claims(redis, "late").run_step(0, IDS, runner("late")) == []


async def test_a_dead_workers_claim_is_taken_over_after_its_ttl(redis) -> None:  # type: ignore[no-untyped-def]
    dead = claims(redis, "dead", ttl=0.3)
    keys = dead._keys(0)
    await dead._seed(keys=[keys[0], keys[2]], args=IDS[:3])
    got = await dead._claim(keys=[keys[0], keys[1]], args=[dead._ttl_ms, "dead"])
    assert got[0].decode() == IDS[0]  # then the process "dies": never renewed, never finished
    before = RECLAIMED._value.get()
    ran: list[str] = []

    async def run(gid: str) -> str:
        ran.append(gid)
        return gid

    out = await asyncio.wait_for(claims(redis, "alive").run_step(0, IDS[:3], run), 10)
    assert sorted(out) == sorted(IDS[:3]) and ran.count(IDS[0]) == 1
    assert RECLAIMED._value.get() - before == 1


async def test_a_restarted_worker_takes_its_own_claims_back_at_once(redis) -> None:  # type: ignore[no-untyped-def]
    """The same worker id after a crash (a supervisor or container restart): its predecessor's
    claims are its own, not a stranger's, so it need not wait out their TTL (it waited 30 s in
    bench/chaos.py's kill:orchestrator)."""
    before = claims(redis, "w", ttl=60.0)
    keys = before._keys(0)
    await before._seed(keys=[keys[0], keys[2]], args=IDS[:3])
    await before._claim(keys=[keys[0], keys[1]], args=[before._ttl_ms, "w"])  # then SIGKILL

    async def run(gid: str) -> str:
        return gid

    out = await asyncio.wait_for(claims(redis, "w", ttl=60.0).run_step(0, IDS[:3], run), 5)
    assert sorted(out) == sorted(IDS[:3])


async def test_a_worker_stops_a_group_whose_claim_another_took(redis) -> None:  # type: ignore[no-untyped-def]
    w = claims(redis, "slow", ttl=0.3, max_groups=1)
    started: Counter[str] = Counter()
    hijacked = asyncio.Event()

    async def run(gid: str) -> str:
        started[gid] += 1
        if started[gid] == 1:
            # Another process takes the claim over (as if this one had stalled past its TTL).
            await redis.hset(w._keys(0)[1], gid, "other")
            hijacked.set()
            await asyncio.sleep(30)  # cancelled by the renewer, well before this
        return gid

    before = CLAIMS_LOST._value.get()
    out = await asyncio.wait_for(w.run_step(0, IDS[:1], run), 10)
    # "other" never finished it; once its claim expired this worker ran the group again.
    assert out == [IDS[0]] and started[IDS[0]] == 2 and hijacked.is_set()
    assert CLAIMS_LOST._value.get() - before == 1


async def test_a_stopped_worker_hands_its_groups_back_at_once(redis) -> None:  # type: ignore[no-untyped-def]
    stopping = claims(redis, "stopping", ttl=60.0, max_groups=3)
    started = asyncio.Event()

    async def hang(gid: str) -> str:
        started.set()
        await asyncio.sleep(60)
        return gid

    task = asyncio.create_task(stopping.run_step(0, IDS[:3], hang))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()  # SIGTERM: the loop is cancelled
    with pytest.raises(asyncio.CancelledError):
        await task

    async def run(gid: str) -> str:
        return gid

    # A 60 s TTL, yet the next worker gets all three immediately.
    out = await asyncio.wait_for(claims(redis, "next").run_step(0, IDS[:3], run), 5)
    assert sorted(out) == sorted(IDS[:3])


async def test_a_step_cancelled_at_any_point_is_cancelled(redis) -> None:  # type: ignore[no-untyped-def]
    """The flake of the test above, made certain: a cancel that lands inside a Redis call of
    the step was swallowed by redis-py, and the step ran on (RedisRetry raises it now)."""

    async def hang(gid: str) -> str:
        await asyncio.sleep(60)
        return gid

    def step(k: int):  # type: ignore[no-untyped-def]
        ids = [f"run{k}/0/p{i}" for i in range(3)]
        return claims(redis, f"w{k}", ttl=60.0, max_groups=3).run_step(0, ids, hang)

    lost = []
    for k in range(40):
        task = asyncio.create_task(step(k))
        for _ in range(k):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await asyncio.wait_for(task, 5)
            lost.append(k)
        except asyncio.CancelledError:
            pass
    assert not lost, f"cancellation swallowed at loop iterations {lost}"


async def test_an_error_in_a_group_ends_the_step_and_releases_the_rest(redis) -> None:  # type: ignore[no-untyped-def]
    w = claims(redis, "w", max_groups=3)

    async def run(gid: str) -> str:
        if gid == IDS[0]:
            raise RuntimeError("boom")
        await asyncio.sleep(60)
        return gid

    with pytest.raises(RuntimeError, match="boom"):
        await asyncio.wait_for(w.run_step(0, IDS[:3], run), 5)
    left = await redis.zrange(w._keys(0)[0], 0, -1, withscores=True)
    assert sorted(k.decode() for k, _ in left) == sorted(IDS[:3])  # none finished
    assert {score for _, score in left} == {0.0}  # and none still claimed


async def test_forget_lets_a_new_run_seed_the_step_again(redis) -> None:  # type: ignore[no-untyped-def]
    w = claims(redis, "w")

    async def run(gid: str) -> str:
        return gid

    assert len(await w.run_step(0, IDS[:2], run)) == 2
    await w.forget()
    assert not await w.done(0)
    assert len(await w.run_step(0, IDS[:2], run)) == 2


async def test_a_long_run_keeps_the_markers_of_its_last_steps_only(redis) -> None:  # type: ignore[no-untyped-def]
    """Each step's `seeded` marker used to stay for the whole run: bench/soak.py's Redis grew by
    one key a step. The last STEPS_KEPT steps keep theirs (a process joining one of them finds
    it done)."""
    w = claims(redis, "w")

    async def run(gid: str) -> str:
        return gid

    for step in range(40):
        assert len(await w.run_step(step, [f"run/{step}/p{i}" for i in range(3)], run)) == 3
    keys = sorted([k.decode() async for k in redis.scan_iter(match="t:partition:*")])
    assert keys == [f"t:partition:seeded:{s}" for s in sorted(range(40 - STEPS_KEPT, 40), key=str)]
    late = claims(redis, "late")
    for step in range(40 - STEPS_KEPT, 40):
        assert await late.run_step(step, [f"run/{step}/p0"], run) == []
