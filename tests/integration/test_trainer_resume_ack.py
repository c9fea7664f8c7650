"""A crash after a checkpoint is durable but before its bus ack: resume re-acks the
checkpoint's receipts, so those trajectories are never trained twice (real Redis, in-process
loop on a tiny model)."""

from __future__ import annotations

import json

import pytest
import torch

from searchr1.bus import TrajectoryBus
from searchr1.redis_server import RedisServer
from searchr1.sections import BusConfig, RunConfig
from tests.unit.trainer.conftest import make_batch, tiny_qwen2
from trainer.backends.hf import HFBackend
from trainer.config import BatchConfig, CheckpointConfig, TrainerConfig
from trainer.dist import DistInfo
from trainer.loop import TrainingLoop

CPU = DistInfo(0, 1, 0, torch.device("cpu"))


class Crash(Exception):
    pass


def make(cfg: TrainerConfig, url: str, max_steps: int) -> tuple[TrainingLoop, TrajectoryBus]:
    bus = TrajectoryBus.from_url(url, BusConfig(consumer="t"))
    run = RunConfig(groups_per_step=1, group_size=4, max_steps=max_steps)
    return TrainingLoop(cfg, HFBackend(tiny_qwen2(), cfg, CPU), CPU, run=run, bus=bus), bus


async def test_resume_reacks_checkpoint_receipts(redis_server: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    trajs = make_batch(3, 4)
    for t in trajs:
        t.group_size = 4
    cfg = TrainerConfig(
        batch=BatchConfig(consume_block_s=0.1),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=1),
    )
    loop, bus = make(cfg, redis_server.url, max_steps=1)
    await bus.publish(trajs)

    async def crash() -> None:
        raise Crash  # the process dies after the checkpoint, before XACK

    loop._ack = crash  # type: ignore[method-assign]
    with pytest.raises(Crash):
        await loop.run()
    await bus.close()
    assert loop.ckpt is not None and loop.ckpt.latest() is not None
    first = {t.trajectory_id for t in trajs if t.group_id == "g0"}

    loop2, bus2 = make(cfg, redis_server.url, max_steps=3)
    trained: list[set[str]] = []
    real_train = loop2._train

    async def spy(batch):  # type: ignore[no-untyped-def]
        trained.append({t.trajectory_id for t in batch})
        return await real_train(batch)

    loop2._train = spy  # type: ignore[method-assign]
    assert await loop2.resume()
    assert loop2.status.step == 1
    await loop2.run()
    assert loop2.status.step == 3
    # Steps 2 and 3 trained the two other groups; the checkpointed group never came back.
    assert len(trained) == 2 and all(not (s & first) for s in trained)
    assert await bus2.backlog() == 0 and await bus2.pending_count() == 0
    await bus2.close()


async def test_a_step_cut_off_at_its_ack_is_still_in_the_metrics_file(
    redis_server: RedisServer, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """The step's line is written once its checkpoint is durable, before the ack: a trainer
    whose ack fails (its lease lost, Redis cut off, killed) leaves the step it saved logged,
    so the chaos ledger counts those trajectories trained, not `unlogged`."""
    trajs = make_batch(1, 4)
    for t in trajs:
        t.group_size = 4
    metrics = tmp_path / "metrics.jsonl"
    cfg = TrainerConfig(
        batch=BatchConfig(consume_block_s=0.1),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=1),
        metrics_jsonl=str(metrics),
    )
    loop, bus = make(cfg, redis_server.url, max_steps=1)
    await bus.publish(trajs)

    async def fenced() -> None:
        raise Crash  # the ack is refused: another trainer holds the lease now

    loop._ack = fenced  # type: ignore[method-assign]
    with pytest.raises(Crash):
        await loop.run()
    await bus.close()
    assert loop.ckpt is not None and loop.ckpt.latest() is not None
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1]
    assert sorted(lines[0]["trajectory_ids"]) == sorted(t.trajectory_id for t in trajs)
