"""A trainer paused past its lease must not act on it (issue 32, split brain).

Acks are fenced in Redis by the lease token, but a weight push to the engines and a checkpoint
on a shared volume are not: a trainer frozen past its TTL (SIGSTOP, a GC pause, a partition
from Redis) whose lease another trainer took meanwhile used to push its weights and write its
checkpoint when it woke, before its lease keeper noticed. Reproduced by blocking the trainer's
event loop past the TTL (nothing runs, as under SIGSTOP) while another holder takes the lease.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
import torch

from searchr1.bus import TrajectoryBus
from searchr1.lease import LeaseLost, RedisLease
from searchr1.redis_server import RedisServer
from searchr1.sections import BusConfig, RunConfig
from tests.unit.trainer.conftest import make_batch, tiny_qwen2
from trainer.backends.hf import HFBackend
from trainer.config import BatchConfig, CheckpointConfig, TrainerConfig
from trainer.dist import DistInfo
from trainer.loop import TrainingLoop
from trainer.weights import PushResult
from trainer.wiring import trainer_lease_key

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
TTL_S = 1.0


class RecordingPusher:
    """The loop's view of a WeightPusher: every push is recorded, none is sent."""

    enabled = True
    releases_engines = False

    def __init__(self) -> None:
        self.pushed: list[int] = []

    def due(self, step: int) -> bool:
        return True

    async def push(self, backend: Any, step: int) -> Any:
        self.pushed.append(step)
        return PushResult(weight_version=step, seconds=0.0, bytes=0)

    async def engines_behind(self, version: int) -> bool:
        return False

    async def close(self) -> None:
        pass


async def test_a_trainer_frozen_past_its_lease_neither_pushes_nor_checkpoints(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    publisher = TrajectoryBus.from_url(redis_server.url, BusConfig(consumer="publisher"))
    trajs = make_batch(2, 4)
    for t in trajs:
        t.group_size = 4
    await publisher.publish(trajs)
    await publisher.close()

    cfg = TrainerConfig(
        batch=BatchConfig(consume_block_s=0.1),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=1),
    )
    bus = TrajectoryBus.from_url(redis_server.url, BusConfig(consumer="t"))
    pusher = RecordingPusher()
    run = RunConfig(groups_per_step=1, group_size=4, max_steps=2)
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    loop = TrainingLoop(cfg, backend, CPU, run=run, bus=bus, pusher=pusher)
    lease = RedisLease(bus.redis, trainer_lease_key(bus.stream), ttl_s=TTL_S)
    await lease.acquire()
    bus.fence_with(lease.key, lease.token)

    real_train = loop._train

    async def frozen_then_train(batch):  # type: ignore[no-untyped-def]
        # The whole process stops past the TTL (nothing runs: no renewal either) while another
        # trainer takes the expired lease.
        time.sleep(TTL_S * 1.5)
        other = redis_sync.Redis.from_url(redis_server.url)
        assert other.set(lease.key, '{"token": "other", "host": "b", "pid": 2}', nx=True, px=60_000)
        other.close()
        return await real_train(batch)

    loop._train = frozen_then_train  # type: ignore[method-assign]
    with pytest.raises(LeaseLost):
        await loop.run(holds_lease=lease.check)
    assert pusher.pushed == []  # the woken trainer pushed nothing to the engines
    assert loop.ckpt is not None and loop.ckpt.latest() is None  # and wrote no checkpoint
    assert await bus.pending_count() == 4  # its group stays pending for the new holder
    await bus.close()


async def test_check_passes_while_renewed_and_fails_once_the_ttl_ran_out(
    redis_server: RedisServer,
) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    lease = RedisLease(client, "k", ttl_s=0.3)
    with pytest.raises(LeaseLost):
        lease.check()  # never acquired
    await lease.acquire()
    lease.check()
    time.sleep(0.35)
    with pytest.raises(LeaseLost, match="not renewed"):
        lease.check()
    await client.aclose()
