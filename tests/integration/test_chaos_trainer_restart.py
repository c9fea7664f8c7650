"""Found by bench/chaos.py: a trainer SIGKILLed while holding bus entries came back (under a
new pid, or in a new pod) as a new consumer, so the entries its predecessor held stayed pending
until `bus.reclaim_idle_s` (60 s): every trainer crash stalled the run a minute. The trainer
is the only consumer of its stream (its Redis lease), so it consumes under one stable name and
a restarted trainer reads back its predecessor's pending entries at once (real Redis)."""

from __future__ import annotations

import itertools

import pytest

import searchr1.bus as bus_module
from searchr1.bus import TrajectoryBus
from searchr1.redis_server import RedisServer
from searchr1.sections import BusConfig
from tests.unit.trainer.conftest import make_batch
from trainer.wiring import make_bus


async def test_a_restarted_trainer_gets_its_predecessors_entries_at_once(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = itertools.count(100)  # each trainer process has its own pid
    monkeypatch.setattr(bus_module, "default_consumer_name", lambda: f"host-{next(pids)}")
    producer = TrajectoryBus.from_url(redis_server.url, BusConfig(consumer="orchestrator"))
    await producer.publish(make_batch(1, 4))

    first = make_bus(redis_server.url, BusConfig())
    held = await first.consume(4, block=1.0)
    assert len(held) == 4
    await first.close()  # SIGKILLed: nothing acked

    second = make_bus(redis_server.url, BusConfig())  # reclaim_idle_s is 60 s
    again = await second.consume(4, block=0.5)
    assert sorted(d.trajectory_id for d in again) == sorted(d.trajectory_id for d in held)
    await second.close()
    await producer.close()
