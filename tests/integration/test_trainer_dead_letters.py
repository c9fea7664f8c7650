"""The trainer and poison data (real Redis, in-process loop on a tiny model): a batch whose
training keeps raising crashes the trainer loudly, and on its last allowed delivery it is
dead-lettered with the error, so the crash-restart loop ends; entries merely held beside it are
not charged for those crashes; a group that never completes is dead-lettered after
`trainer.batch.incomplete_group_timeout_s`. Every other trajectory is trained exactly once."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import REGISTRY

from protos.trajectory import Trajectory
from searchr1.bus import TrajectoryBus
from searchr1.redis_server import RedisServer
from searchr1.sections import BusConfig, RunConfig
from tests.unit.trainer.conftest import make_batch, tiny_qwen2
from trainer import loop as loop_module
from trainer.backends.hf import HFBackend
from trainer.config import BatchConfig, CheckpointConfig, TrainerConfig
from trainer.dist import DistInfo
from trainer.loop import TrainingLoop

CPU = DistInfo(0, 1, 0, torch.device("cpu"))


def dead_total(reason: str) -> float:
    return REGISTRY.get_sample_value("searchr1_bus_dead_letters_total", {"reason": reason}) or 0.0


def groups(names: list[str], size: int) -> list[Trajectory]:
    """Groups named `names`, published in that order."""
    trajs = make_batch(len(names), size)
    for t in trajs:
        name = names[int(t.group_id[1:])]
        t.trajectory_id = t.trajectory_id.replace(t.group_id, name, 1)
        t.group_id, t.group_size = name, size
    return trajs


def make(
    cfg: TrainerConfig, url: str, run: RunConfig, **bus: object
) -> tuple[TrainingLoop, TrajectoryBus]:
    b = TrajectoryBus.from_url(url, BusConfig(consumer="t", **bus))  # type: ignore[arg-type]
    return TrainingLoop(cfg, HFBackend(tiny_qwen2(), cfg, CPU), CPU, run=run, bus=b), b


async def test_a_batch_that_keeps_failing_ends_in_the_dead_letter_stream(
    redis_server: RedisServer, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    before = dead_total("train_error")
    # The poison group g0 crashes the trainer again and again; g2 and g3 come after it.
    trajs = groups(["g1", "g0", "g2", "g3"], size=2)
    real_train_on = loop_module.train_on
    trained: list[set[str]] = []

    def train_on(batch, backend, cfg):  # type: ignore[no-untyped-def]
        if any(t.group_id == "g0" for t in batch):
            raise ValueError("poison trajectory: position ids past the model's context")
        trained.append({t.group_id for t in batch})
        return real_train_on(batch, backend, cfg)

    monkeypatch.setattr(loop_module, "train_on", train_on)
    cfg = TrainerConfig(
        batch=BatchConfig(consume_block_s=0.1),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=1),
    )
    run = RunConfig(groups_per_step=1, group_size=2, max_steps=3)
    publisher = TrajectoryBus.from_url(redis_server.url, BusConfig())
    await publisher.publish(trajs)
    crashes = 0
    for _ in range(6):  # a supervisor restarting the trainer
        loop, bus = make(cfg, redis_server.url, run, max_deliveries=3)
        await loop.resume()
        try:
            # Bounded: a trainer whose good data was thrown away would wait for data forever.
            await asyncio.wait_for(loop.run(), 60)
        except ValueError as e:
            assert "poison" in str(e)  # every failure is loud, the last one too
            crashes += 1
            continue
        finally:
            await bus.close()
        break
    assert crashes == 3  # deliveries 1, 2 and 3 of g0; the restart after the third goes on
    assert loop.status.step == 3
    # g1 before the poison, g2 and g3 after it: each trained once, none charged for g0.
    assert trained == [{"g1"}, {"g2"}, {"g3"}]
    dead = await publisher.dead_letters()
    assert sorted(d["tid"] for d in dead) == [b"g0-s0", b"g0-s1"]
    assert {d["reason"] for d in dead} == {b"train_error"}
    assert all(b"ValueError: poison trajectory" in d["error"] for d in dead)
    assert {d["deliveries"] for d in dead} == {b"3"}
    assert dead_total("train_error") == before + 2
    assert await publisher.backlog() == 0 and await publisher.pending_count() == 0
    await publisher.close()


async def test_an_incomplete_group_is_dead_lettered_after_the_timeout(
    redis_server: RedisServer,
) -> None:
    before = dead_total("incomplete_group")
    half = groups(["g-half"], size=4)[:2]  # 2 of its 4 members ever arrive
    cfg = TrainerConfig(
        batch=BatchConfig(consume_block_s=0.05, incomplete_group_timeout_s=0.3),
    )
    loop, bus = make(cfg, redis_server.url, RunConfig(groups_per_step=1, group_size=4, max_steps=1))
    trained: list[set[str]] = []
    real_train = loop._train

    async def spy(batch):  # type: ignore[no-untyped-def]
        trained.append({t.group_id for t in batch})
        return await real_train(batch)

    loop._train = spy  # type: ignore[method-assign]
    await bus.publish(half)
    run = asyncio.ensure_future(loop.run())
    while not await bus.dead_letters():  # the loop is waiting for data meanwhile
        assert not run.done(), run.result()
        await asyncio.sleep(0.05)
    await bus.publish(groups(["g-full"], size=4))
    await asyncio.wait_for(run, 60)
    assert trained == [{"g-full"}]
    dead = await bus.dead_letters()
    assert sorted(d["tid"] for d in dead) == [b"g-half-s0", b"g-half-s1"]
    assert {d["reason"] for d in dead} == {b"incomplete_group"}
    assert all(b"2 of 4" in d["error"] for d in dead)
    assert dead_total("incomplete_group") == before + 2
    assert await bus.backlog() == 0 and await bus.pending_count() == 0
    await bus.close()
