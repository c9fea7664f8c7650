"""A full disk under the checkpoint directory (issue 32): a real ENOSPC from a small tmpfs.

The save fails as "disk full", naming the directory, leaves no partial checkpoint behind and
keeps the last good one; the loop counts it, logs it and trains on (the steps since the last
good checkpoint stay unacknowledged on the bus), and the next checkpoint after room is made
makes them all durable. A run that must stop while the disk is full fails loudly, and the
restart resumes from the last good checkpoint without losing a trajectory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.small_disk import fill
from searchr1.bus import TrajectoryBus
from searchr1.redis_server import RedisServer
from searchr1.sections import BusConfig, RunConfig
from tests.support.small_disk import small_tmpfs
from tests.unit.trainer.conftest import make_batch, tiny_qwen2
from trainer.backends.hf import HFBackend
from trainer.checkpoint import CheckpointDiskFull, CheckpointManager, TrainerState
from trainer.config import BatchConfig, CheckpointConfig, TrainerConfig
from trainer.dist import DistInfo
from trainer.loop import TrainingLoop
from trainer.metrics import ERRORS

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
SIZE = 8 * 2**20  # room for two checkpoints of the tiny model, not for a filler as well


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real, small filesystem: tmpfs (needs root, as in the project's CI)."""
    with small_tmpfs(tmp_path / "disk", SIZE) as disk:
        yield disk


def errors(stage: str) -> float:
    return ERRORS.labels(stage)._value.get()


def test_a_save_into_a_full_disk_says_so_and_keeps_the_last_good_checkpoint(
    small_disk: Path,
) -> None:
    cfg = TrainerConfig(checkpoint=CheckpointConfig(dir=str(small_disk / "ckpt")))
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    mgr = CheckpointManager(cfg.checkpoint)
    good = mgr.save(backend, TrainerState(step=1))
    filler = fill(small_disk)
    with pytest.raises(CheckpointDiskFull) as err:
        mgr.save(backend, TrainerState(step=2))
    assert str(small_disk / "ckpt") in str(err.value) and "disk full" in str(err.value)
    assert mgr.latest() == good
    # Nothing partial is left taking room: only the good checkpoint and the pointer.
    assert sorted(p.name for p in (small_disk / "ckpt").iterdir()) == ["latest", good.name]
    filler.unlink()
    assert mgr.save(backend, TrainerState(step=2)) == mgr.latest() == mgr.path_for(2)


def _checkpoint_every_step(disk: Path) -> TrainerConfig:
    return TrainerConfig(
        batch=BatchConfig(consume_block_s=0.1),
        checkpoint=CheckpointConfig(dir=str(disk / "ckpt"), every_steps=1),
    )


def _loop(cfg: TrainerConfig, url: str, max_steps: int) -> tuple[TrainingLoop, TrajectoryBus]:
    bus = TrajectoryBus.from_url(url, BusConfig(consumer="t"))
    run = RunConfig(groups_per_step=1, group_size=4, max_steps=max_steps)
    return TrainingLoop(cfg, HFBackend(tiny_qwen2(), cfg, CPU), CPU, run=run, bus=bus), bus


async def _published(url: str, groups: int) -> dict[str, set[str]]:
    trajs = make_batch(groups, 4)
    for t in trajs:
        t.group_size = 4
    bus = TrajectoryBus.from_url(url, BusConfig(consumer="publisher"))
    await bus.publish(trajs)
    await bus.close()
    out: dict[str, set[str]] = {}
    for t in trajs:
        out.setdefault(t.group_id or "", set()).add(t.trajectory_id)
    return out


def _spy(loop: TrainingLoop, trained: list[set[str]], before_step: dict[int, object]) -> None:
    real = loop._train

    async def train(batch):  # type: ignore[no-untyped-def]
        action = before_step.get(len(trained) + 1)
        if callable(action):
            action()
        trained.append({t.trajectory_id for t in batch})
        return await real(batch)

    loop._train = train  # type: ignore[method-assign]


async def test_the_loop_trains_on_through_a_full_disk_and_checkpoints_once_there_is_room(
    redis_server: RedisServer, small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await _published(redis_server.url, 3)
    cfg = _checkpoint_every_step(small_disk)
    loop, bus = _loop(cfg, redis_server.url, max_steps=3)
    fillers: list[Path] = []
    trained: list[set[str]] = []
    # Step 2's checkpoint meets a full disk; room is made before step 3.
    _spy(
        loop, trained, {2: lambda: fillers.append(fill(small_disk)), 3: lambda: fillers[0].unlink()}
    )
    before = errors("checkpoint_disk_full")
    with caplog.at_level(logging.ERROR, logger="trainer.loop"):
        await loop.run()
    assert loop.status.step == 3 and len(trained) == 3
    assert errors("checkpoint_disk_full") == before + 1
    full = [r for r in caplog.records if "disk full" in r.getMessage()]
    assert len(full) == 1, [r.getMessage() for r in caplog.records]
    assert loop.ckpt is not None and loop.ckpt.latest() == loop.ckpt.path_for(3)
    # Step 2's receipts went into step 3's checkpoint and were acknowledged with it.
    assert await bus.pending_count() == 0 and await bus.backlog() == 0
    await bus.close()


async def test_a_run_that_stops_on_a_full_disk_fails_and_resumes_from_the_last_good_checkpoint(
    redis_server: RedisServer, small_disk: Path
) -> None:
    groups = await _published(redis_server.url, 3)
    cfg = _checkpoint_every_step(small_disk)
    loop, bus = _loop(cfg, redis_server.url, max_steps=2)
    fillers: list[Path] = []
    first: list[set[str]] = []
    _spy(loop, first, {2: lambda: fillers.append(fill(small_disk))})
    with pytest.raises(CheckpointDiskFull):
        await loop.run()  # step 2 trained, its (final) checkpoint cannot be written
    await bus.close()
    assert loop.ckpt is not None and loop.ckpt.latest() == loop.ckpt.path_for(1)
    fillers[0].unlink()

    again, bus2 = _loop(cfg, redis_server.url, max_steps=3)
    second: list[set[str]] = []
    _spy(again, second, {})
    assert await again.resume() and again.status.step == 1
    await again.run()
    # Step 2 was never durable: its group is trained again, once, then the last group.
    durable = first[:1] + second
    assert sorted(map(sorted, durable)) == sorted(map(sorted, groups.values()))
    assert await bus2.pending_count() == 0 and await bus2.backlog() == 0
    await bus2.close()
