"""The engine's parts on their own, without `TorchEngine` or the HTTP server: the pause lease,
the scheduler over a model, and weight updates through that scheduler."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference.config import TorchEngineConfig
from inference.memory import MemoryState
from inference.pause import PAUSE_EXPIRED, PauseLease, check_mode
from inference.prompts import eos_token_ids
from inference.requests import Request
from inference.sampling import SamplingParams, make_generator
from inference.scheduler import EngineOverloaded, Scheduler
from inference.weight_updates import WeightUpdates
from searchr1.weightsync.receiver import WeightLoader


def test_a_pause_runs_out_and_drops_the_open_push() -> None:
    dropped: list[bool] = []
    lease = PauseLease(0.05, on_expire=lambda: dropped.append(True) or True)
    before = PAUSE_EXPIRED._value.get()
    lease.hold()
    assert lease.paused and 0 < lease.left() <= 0.05
    time.sleep(0.06)
    assert lease.left() <= 0
    lease.expire()
    assert not lease.paused and lease.expired == 1 and dropped == [True]
    assert PAUSE_EXPIRED._value.get() == before + 1


def test_renewing_moves_the_deadline_and_release_resumes() -> None:
    lease = PauseLease(10.0, on_expire=lambda: False)
    lease.hold()
    first = lease.deadline
    time.sleep(0.01)
    lease.renew()
    assert lease.deadline > first
    lease.release()
    assert not lease.paused and lease.expired == 0


def test_an_unknown_pause_mode_is_refused_by_name() -> None:
    for mode in ("abort", "in_place", "retract"):
        check_mode(mode)
    with pytest.raises(ValueError, match=r"mode must be one of .* 'freeze'"):
        check_mode("freeze")


class Parts:
    def __init__(self, model_dir: Path, cfg: TorchEngineConfig) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()
        self.loader = WeightLoader(self.model, timeout_s=5)
        self.memory = MemoryState(
            self.model, torch.device("cpu"), flush_kv=lambda: self.scheduler.flush_kv()
        )
        self.pause = PauseLease(cfg.pause_lease_s, on_expire=lambda: self.updates.drop_session())
        self.scheduler = Scheduler(
            self.model,
            self.tokenizer,
            cfg,
            eos_ids=eos_token_ids(self.model, self.tokenizer),
            context_length=256,
            memory=self.memory,
            pause=self.pause,
        )
        self.updates = WeightUpdates(
            self.loader, self.scheduler, self.memory, self.pause, str(model_dir)
        )

    def request(self, n: int) -> Request:
        loop = asyncio.get_running_loop()
        params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        return Request(
            rid=f"r{n}",
            input_ids=[1, 2, 3],
            params=params,
            loop=loop,
            future=loop.create_future(),
            generator=make_generator(None),
        )


@pytest.fixture
async def parts(tiny_model_dir: Path) -> AsyncIterator[Parts]:
    p = Parts(tiny_model_dir, TorchEngineConfig(max_queued_requests=2, prefix_cache_tokens=256))
    p.scheduler.start()
    yield p
    p.scheduler.stop()
    p.loader.close()


async def test_the_scheduler_alone_generates_and_stops_with_aborts(parts: Parts) -> None:
    req = parts.request(5)
    parts.scheduler.submit(req)
    out = await asyncio.wait_for(req.future, 30)
    assert len(out.output_ids) == 5 and out.finish_reason["type"] == "length"
    assert out.weight_version == 0


async def test_the_scheduler_refuses_past_its_queue_and_aborts_on_pause(parts: Parts) -> None:
    await parts.scheduler.run_command(parts.pause.hold)  # nothing runs: the queue fills
    reqs = [parts.request(4), parts.request(4)]
    for r in reqs:
        parts.scheduler.submit(r)
    with pytest.raises(EngineOverloaded, match="max_queued_requests"):
        parts.scheduler.submit(parts.request(4))
    await parts.scheduler.run_command(lambda: parts.scheduler.abort_all("test"))
    outs: list[Any] = [await asyncio.wait_for(r.future, 10) for r in reqs]
    assert [o.finish_reason["type"] for o in outs] == ["abort", "abort"]


async def test_weight_updates_through_the_scheduler_move_the_version_and_flush(
    parts: Parts, seed1_dir: Path
) -> None:
    warm = parts.request(3)
    parts.scheduler.submit(warm)
    await asyncio.wait_for(warm.future, 30)
    assert parts.scheduler.prefix_cache is not None
    assert parts.scheduler.prefix_cache.stats.tokens > 0
    assert await parts.updates.from_disk(str(seed1_dir), version=7) == 7
    assert parts.scheduler.weight_version == 7 and parts.updates.model_path == str(seed1_dir)
    assert parts.scheduler.prefix_cache.stats.tokens == 0  # K/V of the old weights: gone
    await parts.updates.begin()
    assert parts.loader.session is not None
    assert await parts.updates.end() == 7  # no bucket carried a version: unchanged
    assert parts.loader.session is None
