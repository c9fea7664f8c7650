"""Release/resume inside `TorchEngine` (in process): the idle rule against real requests, the
session rule, and a retracted request that waits out a release and finishes on new weights."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.engine import TorchEngine
from inference.memory import MemoryReleased
from inference.sampling import SamplingParams

PROMPT = [1, 60, 61, 62]


@pytest.fixture
def engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:
    eng = TorchEngine(tiny_model_dir)
    yield eng
    eng.shutdown()


def long(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


async def until(check: object, what: str, timeout_s: float = 60) -> None:
    """Wait (bounded) for a condition the scheduler thread makes true."""
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def test_release_refused_while_a_request_runs(engine: TorchEngine) -> None:
    task = asyncio.create_task(engine.generate(PROMPT, long(3000)))
    await until(
        lambda: engine.scheduler.running and engine.scheduler.running[0].output_ids,
        "a running request",
    )
    with pytest.raises(ValueError, match="idle engine"):
        await engine.release_memory(None)
    assert engine.memory.serving
    await engine.abort_all("test")
    assert (await task).finish_reason["type"] == "abort"
    await engine.release_memory(["kv_cache"])
    with pytest.raises(MemoryReleased):
        await engine.generate(PROMPT, long(2))
    await engine.resume_memory(["kv_cache"])
    assert len((await engine.generate(PROMPT, long(2))).output_ids) == 2


async def test_weights_and_sessions_exclude_each_other(engine: TorchEngine) -> None:
    await engine.begin_weight_update()
    with pytest.raises(ValueError, match="session is open"):
        await engine.release_memory(["weights"])
    await engine.end_weight_update()
    await engine.release_memory(["weights"])
    with pytest.raises(ValueError, match="weights are released"):
        await engine.begin_weight_update()
    await engine.resume_memory(["weights"])


async def test_retracted_request_waits_out_a_release_and_ends_on_new_weights(
    engine: TorchEngine, tiny_model_dir: Path
) -> None:
    task = asyncio.create_task(engine.generate(PROMPT, long(40)))
    await until(
        lambda: engine.scheduler.running and engine.scheduler.running[0].output_ids,
        "a running request",
    )
    await engine.pause("retract")
    await engine.release_memory(None)  # paused: the retracted request may wait
    await engine.resume()  # continue_generation: still held, nothing to run on
    await engine.run_command(lambda: None)  # a scheduler pass went by
    assert not task.done() and len(engine.scheduler.waiting) == 1
    await engine.resume_memory(None)
    await engine.run_command(lambda: None)
    assert not task.done() and engine.memory.awaiting_weights
    await engine.update_weights_from_disk(str(tiny_model_dir), version=7)
    out = await task
    assert len(out.output_ids) == 40 and out.finish_reason["type"] == "length"
    assert out.weight_versions()[-1]["version"] == "7"
