"""Poison entries on the bus (real redis-server): delivery counts are Redis's own, an entry
delivered more than `bus.max_deliveries` times goes to `<stream>:dead` instead of a consumer,
and a consumer can dead-letter or forgive what it holds."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from searchr1.bus import TrajectoryBus
from searchr1.redis_server import RedisServer
from searchr1.sections import BusConfig
from tests.factories import make_trajectory


def bus_for(server: RedisServer, **overrides: object) -> TrajectoryBus:
    cfg = BusConfig(**{"reconnect_timeout_s": 20.0, **overrides})  # type: ignore[arg-type]
    return TrajectoryBus.from_url(server.url, cfg)


def dead_total(reason: str) -> float:
    return REGISTRY.get_sample_value("searchr1_bus_dead_letters_total", {"reason": reason}) or 0.0


async def crash_after_consume(server: RedisServer, **cfg: object) -> list[tuple[str, int]]:
    """A consumer that takes what it is given and dies without acking."""
    bus = bus_for(server, consumer="trainer-0", **cfg)
    try:
        return [(d.trajectory_id, d.delivery_count) for d in await bus.consume(10, block=0.2)]
    finally:
        await bus.close()


async def test_delivery_count_counts_every_delivery(redis_server: RedisServer) -> None:
    await bus_for(redis_server).publish([make_trajectory("t-0")])
    # Redelivered to the restarted consumer (its own pending entries), twice ...
    assert await crash_after_consume(redis_server) == [("t-0", 1)]
    assert await crash_after_consume(redis_server) == [("t-0", 2)]
    assert await crash_after_consume(redis_server) == [("t-0", 3)]
    # ... then reclaimed by another consumer.
    other = bus_for(redis_server, consumer="other", reclaim_idle_s=0.05)
    await asyncio.sleep(0.1)
    [d] = await other.consume(10, block=0.1)
    assert (d.trajectory_id, d.delivery_count) == ("t-0", 4)
    await other.ack([d])
    await other.close()


async def test_entry_delivered_more_than_max_deliveries_is_dead_lettered(
    redis_server: RedisServer,
) -> None:
    before = dead_total("max_deliveries")
    producer = bus_for(redis_server)
    await producer.publish([make_trajectory("poison", group_id="g-p")])
    # A consumer killed by the entry every time (OOM, segfault: no exception to catch).
    for n in (1, 2, 3):
        assert await crash_after_consume(redis_server, max_deliveries=3) == [("poison", n)]
    assert await crash_after_consume(redis_server, max_deliveries=3) == []  # never a 4th

    consumer = bus_for(redis_server, consumer="trainer-0", max_deliveries=3)
    [dead] = await consumer.dead_letters()
    assert dead["reason"] == b"max_deliveries"
    assert dead["tid"] == b"poison" and dead["deliveries"] == b"4"
    assert b"max_deliveries=3" in dead["error"] and dead["source_id"]
    assert dead_total("max_deliveries") == before + 1
    assert await consumer.backlog() == 0 and await consumer.pending_count() == 0
    # A dead trajectory republished (an orchestrator restart) is not delivered again; other
    # entries are untouched.
    await producer.publish([make_trajectory("poison", group_id="g-p"), make_trajectory("fine")])
    got = await consumer.consume(10, block=0.2)
    assert [(d.trajectory_id, d.delivery_count) for d in got] == [("fine", 1)]
    await consumer.ack(got)
    assert await consumer.backlog() == 0
    await producer.close()
    await consumer.close()


async def test_restarted_consumer_pages_through_its_own_pending(redis_server: RedisServer) -> None:
    await bus_for(redis_server).publish([make_trajectory(f"t-{i}") for i in range(5)])
    before = bus_for(redis_server, consumer="trainer-0")
    assert len(await before.consume(5, block=0.2)) == 5
    await before.close()  # crashed holding 5
    after = bus_for(redis_server, consumer="trainer-0")
    pages = [await after.consume(2, block=0.1) for _ in range(3)]
    assert [[d.trajectory_id for d in p] for p in pages] == [
        ["t-0", "t-1"],
        ["t-2", "t-3"],
        ["t-4"],
    ]
    await after.ack([d for p in pages for d in p])
    await after.close()


async def test_consumer_dead_letters_and_forgives_what_it_holds(redis_server: RedisServer) -> None:
    before = dead_total("train_error")
    await bus_for(redis_server).publish(
        [make_trajectory("bad"), make_trajectory("ok-1"), make_trajectory("ok-2")]
    )
    bus = bus_for(redis_server, consumer="trainer-0")
    held = {d.trajectory_id: d for d in await bus.consume(10, block=0.2)}
    await bus.dead_letter([held["bad"]], "train_error", "ValueError: token 7 out of range")
    # It is about to crash because of "bad": the others' next delivery must not count.
    await bus.forgive_held()
    await bus.close()
    [dead] = await bus_for(redis_server).dead_letters()
    assert (dead["reason"], dead["tid"]) == (b"train_error", b"bad")
    assert dead["error"] == b"ValueError: token 7 out of range"
    assert dead_total("train_error") == before + 1
    again = bus_for(redis_server, consumer="trainer-0")
    got = await again.consume(10, block=0.2)
    assert sorted((d.trajectory_id, d.delivery_count) for d in got) == [("ok-1", 1), ("ok-2", 1)]
    await again.ack(got)
    assert await again.backlog() == 0 and await again.pending_count() == 0
    await again.close()


def test_cli_lists_dead_letters(redis_server: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from stack.cli import app

    async def setup() -> None:
        bus = bus_for(redis_server, consumer="trainer-0")
        await bus.publish([make_trajectory("bad"), make_trajectory("ok")])
        got = {d.trajectory_id: d for d in await bus.consume(10, block=0.2)}
        await bus.dead_letter([got["bad"]], "train_error", "ValueError: boom")
        await bus.close()

    asyncio.run(setup())
    config = tmp_path / "stack.yaml"
    config.write_text(f"redis:\n  url: {redis_server.url}\n")
    listed = CliRunner().invoke(app, ["bus", "dead-letters", "-c", str(config)])
    assert listed.exit_code == 0, listed.output
    assert "tid=bad reason=train_error deliveries=1" in listed.output
    assert "error='ValueError: boom'" in listed.output
    stats = CliRunner().invoke(app, ["bus", "stats", "-c", str(config)])
    assert "backlog=1 pending=1 undelivered=0 dead_letters=1" in stats.output
