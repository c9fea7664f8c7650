"""The trajectory bus against a real redis-server process (no fakes)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from prometheus_client import REGISTRY

from protos.trajectory import Trajectory
from searchr1.bus import BusUnavailable, TrajectoryBus
from searchr1.redis_server import RedisServer
from searchr1.sections import BusConfig
from tests.factories import make_trajectory


def bus_for(server: RedisServer, **overrides: object) -> TrajectoryBus:
    cfg = BusConfig(**{"reconnect_timeout_s": 20.0, **overrides})  # type: ignore[arg-type]
    return TrajectoryBus.from_url(server.url, cfg)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def drain(bus: TrajectoryBus, *, ack: bool = True, rounds: int = 50) -> list[Trajectory]:
    got: list[Trajectory] = []
    for _ in range(rounds):
        batch = await bus.consume(64, block=0.05)
        if not batch:
            break
        got += [d.trajectory for d in batch]
        if ack:
            await bus.ack(batch)
    return got


async def test_round_trip_preserves_every_field(redis_server: RedisServer) -> None:
    producer, consumer = bus_for(redis_server), bus_for(redis_server, consumer="c1")
    sent = make_trajectory("t-round-trip", response_len=300, seed=3)
    await producer.publish([sent])
    [delivery] = await consumer.consume(10, block=1)
    # Protobuf equality compares every field, the per-token arrays and nested turns included.
    assert delivery.trajectory == sent
    assert list(delivery.trajectory.rollout_logprobs) == pytest.approx(
        list(sent.rollout_logprobs), abs=0
    )
    assert delivery.trajectory.turns[0].doc_ids == ["12", "7", "99"]
    assert await consumer.ack([delivery]) == 1
    assert await consumer.backlog() == 0
    await producer.close()
    await consumer.close()


async def test_duplicate_delivery_is_consumed_once(redis_server: RedisServer) -> None:
    producer, consumer = bus_for(redis_server), bus_for(redis_server, consumer="c1")
    dup_before = metric("searchr1_bus_duplicates_total")
    a, b = make_trajectory("t-a"), make_trajectory("t-b")
    # The same trajectory twice before any ack (a producer retry after a lost reply) ...
    await producer.publish([a, b, a])
    batch = await consumer.consume(10, block=1)
    assert sorted(d.trajectory_id for d in batch) == ["t-a", "t-b"]
    await consumer.ack(batch)
    # ... and once more after it was consumed (a restarted producer republishing a group).
    await producer.publish([a])
    assert await consumer.consume(10, block=0.2) == []
    assert metric("searchr1_bus_duplicates_total") - dup_before == 2
    assert await consumer.backlog() == 0  # duplicates are acked away, never left pending
    assert await consumer.pending_count() == 0


_DYING_CONSUMER = textwrap.dedent(
    """
    import asyncio, sys, time
    from searchr1.bus import TrajectoryBus
    from searchr1.sections import BusConfig

    async def main():
        bus = TrajectoryBus.from_url(sys.argv[1], BusConfig(consumer="doomed"))
        got = await bus.consume(5, block=5)
        print(" ".join(d.trajectory_id for d in got), flush=True)
        time.sleep(600)  # "training": killed before it acks

    asyncio.run(main())
    """
)


async def test_killed_consumer_entries_are_reclaimed(redis_server: RedisServer) -> None:
    producer = bus_for(redis_server)
    await producer.publish([make_trajectory(f"t-{i}") for i in range(8)])
    proc = subprocess.Popen(
        [sys.executable, "-c", _DYING_CONSUMER, redis_server.url],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.stdout is not None
    taken = (await asyncio.to_thread(proc.stdout.readline)).split()
    assert len(taken) == 5
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    survivor = bus_for(redis_server, consumer="survivor", reclaim_idle_s=0.3)
    first = await survivor.consume(10, block=0.1)  # the 3 never delivered; the 5 not idle yet
    assert {d.trajectory_id for d in first} == {f"t-{i}" for i in range(8)} - set(taken)
    await asyncio.sleep(0.4)
    reclaimed = await survivor.consume(10, block=0.1)
    assert sorted(d.trajectory_id for d in reclaimed) == sorted(taken)
    assert all(d.delivery_count > 1 for d in reclaimed)
    await survivor.ack([*first, *reclaimed])
    assert await survivor.backlog() == 0


async def test_restarted_consumer_gets_its_own_pending_back(redis_server: RedisServer) -> None:
    producer = bus_for(redis_server)
    await producer.publish([make_trajectory(f"t-{i}") for i in range(3)])
    before = bus_for(redis_server, consumer="trainer-0")
    held = await before.consume(3, block=1)
    await before.close()  # crashed without acking
    after = bus_for(redis_server, consumer="trainer-0")  # same name, long reclaim idle time
    again = await after.consume(10, block=0.1)
    assert [d.trajectory_id for d in again] == [d.trajectory_id for d in held]
    # Acking receipts saved in a checkpoint (no Delivery objects) works the same.
    assert await after.ack([d.receipt for d in again]) == 3
    assert await after.consume(10, block=0.1) == []


async def test_redis_crash_and_restart_with_aof_loses_nothing(redis_server: RedisServer) -> None:
    producer = bus_for(redis_server)
    consumer = bus_for(redis_server, consumer="c1")
    await producer.publish([make_trajectory(f"t-{i}") for i in range(20)])
    first = await consumer.consume(10, block=1)
    await consumer.ack(first)

    async def publish_through_outage() -> None:
        for i in range(20, 60):
            await producer.publish([make_trajectory(f"t-{i}")])
            await asyncio.sleep(0.005)

    publishing = asyncio.create_task(publish_through_outage())
    await asyncio.sleep(0.05)
    redis_server.stop(kill=True)  # a crash: no clean shutdown
    await asyncio.sleep(0.5)
    redis_server.start()
    await publishing
    retries = metric("searchr1_redis_retries_total", component="bus", op="publish")
    assert retries > 0  # the producer really went through the outage

    rest = await drain(consumer)
    ids = [d.trajectory_id for d in first] + [t.trajectory_id for t in rest]
    assert sorted(ids) == sorted(f"t-{i}" for i in range(60))  # nothing lost, nothing twice
    assert len(ids) == len(set(ids))


async def test_consume_and_ack_wait_out_a_redis_restart(redis_server: RedisServer) -> None:
    # Redis stops while the consumer is blocked in XREADGROUP and while it acks; a new
    # redis-server on the same port and data dir (AOF) comes back; both calls complete.
    producer, consumer = bus_for(redis_server), bus_for(redis_server, consumer="c1")
    await consumer.ensure_group()
    blocked = asyncio.ensure_future(consumer.consume(10, block=5))
    await asyncio.sleep(0.1)  # in XREADGROUP BLOCK (if not, the read below still gets it)
    before = metric("searchr1_redis_retries_total", component="bus", op="read")
    redis_server.stop()
    while metric("searchr1_redis_retries_total", component="bus", op="read") == before:
        assert not blocked.done(), blocked.result()  # returned or raised instead of retrying
        await asyncio.sleep(0.01)
    await asyncio.to_thread(redis_server.start)
    await producer.publish([make_trajectory("t-0")])
    got = await asyncio.wait_for(blocked, 30)
    assert [d.trajectory_id for d in got] == ["t-0"]
    before = metric("searchr1_redis_retries_total", component="bus", op="ack")
    redis_server.stop()
    acking = asyncio.ensure_future(consumer.ack(got))
    while metric("searchr1_redis_retries_total", component="bus", op="ack") == before:
        assert not acking.done(), acking.result()
        await asyncio.sleep(0.01)
    await asyncio.to_thread(redis_server.start)
    assert await asyncio.wait_for(acking, 30) == 1
    assert await consumer.backlog() == 0 and await consumer.pending_count() == 0


async def test_backpressure_blocks_until_the_consumer_acks(redis_server: RedisServer) -> None:
    producer = bus_for(redis_server, max_backlog=4, backpressure_poll_s=0.01)
    consumer = bus_for(redis_server, consumer="c1")
    await producer.publish([make_trajectory(f"t-{i}") for i in range(4)])
    blocked = asyncio.create_task(producer.publish([make_trajectory("t-4")]))
    await asyncio.sleep(0.3)
    assert not blocked.done()
    batch = await consumer.consume(2, block=1)
    assert not blocked.done()  # delivered but unacked still counts against the bound
    await consumer.ack(batch)
    await asyncio.wait_for(blocked, 5)
    assert await producer.backlog() == 3
    with pytest.raises(ValueError, match="max_backlog"):
        await producer.publish([make_trajectory(f"x-{i}") for i in range(5)])


async def test_malformed_entries_go_to_the_dead_letter_stream(redis_server: RedisServer) -> None:
    producer = bus_for(redis_server)
    consumer = bus_for(redis_server, consumer="c1")
    await consumer.ensure_group()
    before = {
        r: metric("searchr1_bus_dead_letters_total", reason=r)
        for r in ("undecodable", "unknown_version", "missing_data")
    }
    raw = consumer.redis
    await producer.publish([make_trajectory("good-1")])
    await raw.xadd(producer.stream, {"v": "1", "tid": "bad", "data": b"\xff\x00garbage"})
    await raw.xadd(producer.stream, {"v": "99", "tid": "future", "data": b""})
    await raw.xadd(producer.stream, {"v": "1", "tid": "empty"})
    misaligned = make_trajectory("misaligned")
    misaligned.loss_mask = misaligned.loss_mask[
        :-1
    ]  # bypasses encode()'s validation, as a buggy producer would
    await raw.xadd(producer.stream, {"v": "1", "tid": "m", "data": misaligned.SerializeToString()})
    await producer.publish([make_trajectory("good-2")])

    got = await drain(consumer)
    assert [t.trajectory_id for t in got] == ["good-1", "good-2"]
    dead = await consumer.dead_letters()
    assert [d["reason"] for d in dead] == [
        b"undecodable",
        b"unknown_version",
        b"missing_data",
        b"undecodable",
    ]
    assert all(d["source_id"] and d["error"] for d in dead)
    assert b"schema version 99" in dead[1]["error"]
    assert metric("searchr1_bus_dead_letters_total", reason="undecodable") == (
        before["undecodable"] + 2
    )
    assert metric("searchr1_bus_dead_letters_total", reason="unknown_version") == (
        before["unknown_version"] + 1
    )
    assert await consumer.backlog() == 0


async def test_lost_consumer_group_is_recreated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Without persistence a restart loses the stream and the group; the bus must recover.
    with RedisServer(data_dir=tmp_path / "r", appendonly=False) as server:
        bus = bus_for(server, consumer="c1")
        await bus.publish([make_trajectory("t-0")])
        server.restart(kill=True)
        await bus.publish([make_trajectory("t-1")])
        got = await drain(bus)
        assert [t.trajectory_id for t in got] == ["t-1"]


async def test_gives_up_with_a_clear_error_when_redis_stays_down(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with RedisServer(data_dir=tmp_path / "r") as server:
        bus = bus_for(server, reconnect_timeout_s=0.5)
        await bus.ensure_group()
        server.stop()
        with pytest.raises(BusUnavailable, match="unreachable"):
            await bus.publish([make_trajectory("t-0")])
