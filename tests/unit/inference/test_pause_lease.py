"""A pause is a lease: an engine whose trainer vanished mid-push resumes by itself.

Before, only the trainer's `finally` resumed the engines, so a trainer killed mid-push left them
paused for good; and a weight bucket was received on the scheduler thread, so a sender that
died mid-broadcast stalled generation until the group's timeout (600 s)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.config import TorchEngineConfig
from inference.engine import TorchEngine
from inference.sampling import SamplingParams
from searchr1.weightsync.protocol import Bucket

LEASE_S = 0.6


@pytest.fixture
def engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:
    eng = TorchEngine(tiny_model_dir, TorchEngineConfig(pause_lease_s=LEASE_S))
    yield eng
    eng.shutdown()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


async def test_a_pause_expires_when_the_trainer_vanishes(engine: TorchEngine) -> None:
    await engine.pause("retract")
    await engine.begin_weight_update()  # the trainer opened a push, then died
    done = await asyncio.wait_for(engine.generate([1, 2, 3], greedy(4)), 10)
    assert len(done.output_ids) == 4  # generation went on after the lease ran out
    assert engine.pause_leases_expired == 1
    with pytest.raises(ValueError, match="no weight-update session"):
        await engine.end_weight_update()  # its half-received push was discarded


async def test_weight_update_calls_renew_the_lease(engine: TorchEngine) -> None:
    await engine.pause("retract")
    request = asyncio.create_task(engine.generate([1, 2, 3], greedy(4)))
    await engine.begin_weight_update()
    for _ in range(3):  # a long push: each call keeps the engine paused
        await asyncio.sleep(LEASE_S * 0.6)
        await engine.renew_pause()
    assert not request.done() and engine.pause_leases_expired == 0
    await engine.end_weight_update()
    await engine.resume()
    assert len((await asyncio.wait_for(request, 10)).output_ids) == 4


async def test_a_stuck_receive_does_not_stall_generation(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def stuck(*args: object, **kwargs: object) -> None:
        release.wait(30)  # a broadcast whose sender died: gloo waits for its timeout

    monkeypatch.setattr(engine.weights, "receive", stuck)
    await engine.begin_weight_update()
    update = asyncio.create_task(
        engine.update_weights_from_distributed(
            Bucket(names=["w"], dtypes=["float32"], shapes=[[1]], group_name="g")
        )
    )
    await asyncio.sleep(0.1)
    done = await asyncio.wait_for(engine.generate([1, 2, 3], greedy(4)), 10)
    assert len(done.output_ids) == 4 and not update.done()
    release.set()
    await asyncio.wait_for(update, 10)
