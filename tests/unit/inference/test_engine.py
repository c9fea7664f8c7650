"""The reference engine in-process (no HTTP): batching, logprobs, stops, pause, updates."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inference.config import TorchEngineConfig
from inference.engine import TorchEngine
from inference.sampling import SamplingParams
from inference.scheduler import EngineOverloaded


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:
    eng = TorchEngine(tiny_model_dir, TorchEngineConfig(max_prefill_per_step=8))
    yield eng
    eng.shutdown()


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, **kw)  # type: ignore[arg-type]


def teacher_forced_logprobs(
    model: torch.nn.Module, prompt: list[int], out: list[int], temperature: float = 1.0
) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


async def test_logprobs_match_teacher_forcing(engine: TorchEngine) -> None:
    # As SGLang: logprobs of logits / T when sampling; greedy (T = 0) gives temperature 1.
    prompt = [1, 40, 41, 42, 43]
    for params, temperature in (
        (greedy(24), 1.0),
        (SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True), 1.0),
        (
            SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, seed=4, ignore_eos=True),
            0.7,
        ),
    ):
        out = await engine.generate(prompt, params)
        assert len(out.output_ids) == len(out.logprobs) == 24
        ref = teacher_forced_logprobs(engine.model, prompt, out.output_ids, temperature)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)) < 1e-4


async def test_logprobs_at_temperature_07_are_of_logits_over_07(engine: TorchEngine) -> None:
    prompt = [1, 50, 51, 52]
    params = SamplingParams(max_new_tokens=16, temperature=0.7, seed=11, ignore_eos=True)
    out = await engine.generate(prompt, params)
    scaled = teacher_forced_logprobs(engine.model, prompt, out.output_ids, 0.7)
    raw = teacher_forced_logprobs(engine.model, prompt, out.output_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(scaled, out.logprobs, strict=True)) < 1e-4
    # The two distributions really differ here, so the check above can tell them apart.
    assert max(abs(a - b) for a, b in zip(raw, out.logprobs, strict=True)) > 1e-2


async def test_batch_independence(engine: TorchEngine) -> None:
    prompts = [[1, *range(100, 100 + k)] for k in range(1, 33)]  # 32 different lengths
    batched = await asyncio.gather(*(engine.generate(p, greedy(20)) for p in prompts))
    for prompt, b in zip(prompts, batched, strict=True):
        alone = await engine.generate(prompt, greedy(20))
        assert alone.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(alone.logprobs, b.logprobs, strict=True)) < 1e-4


async def test_continuous_batching_join_and_leave(engine: TorchEngine) -> None:
    # A long request keeps running while short ones join and finish around it.
    long_alone = await engine.generate([1, 7, 8], greedy(60))
    long_task = asyncio.create_task(engine.generate([1, 7, 8], greedy(60)))
    await asyncio.sleep(0.01)
    shorts = await asyncio.gather(*(engine.generate([1, 9 + i], greedy(3 + i)) for i in range(6)))
    assert [len(s.output_ids) for s in shorts] == [3 + i for i in range(6)]
    assert (await long_task).output_ids == long_alone.output_ids


async def test_seeded_sampling_reproducible_in_any_batch(engine: TorchEngine) -> None:
    params = SamplingParams(max_new_tokens=16, seed=11)
    a = await engine.generate([1, 2, 3], params)
    noise = [engine.generate([1, 5 + i], SamplingParams(max_new_tokens=10)) for i in range(5)]
    b, *_ = await asyncio.gather(engine.generate([1, 2, 3], params), *noise)
    assert a.output_ids == b.output_ids


async def test_stop_strings_on_decoded_text(engine: TorchEngine) -> None:
    free = await engine.generate([1, 2, 3], greedy(30, skip_special_tokens=False))
    stop = free.text[6:9]
    kept = await engine.generate([1, 2, 3], greedy(30, stop=[stop], no_stop_trim=True))
    assert kept.finish_reason == {"type": "stop", "matched": stop}
    assert kept.text.endswith(stop) or stop in kept.text[-len(stop) - 8 :]
    assert free.output_ids[: len(kept.output_ids)] == kept.output_ids
    trimmed = await engine.generate([1, 2, 3], greedy(30, stop=[stop]))
    assert trimmed.output_ids == kept.output_ids
    assert stop not in trimmed.text and kept.text.startswith(trimmed.text)


async def test_stop_token_ids_and_length(engine: TorchEngine) -> None:
    free = await engine.generate([1, 2, 3], greedy(8))
    assert free.finish_reason == {"type": "length", "length": 8}
    tok = free.output_ids[2]
    first = free.output_ids.index(tok)
    out = await engine.generate([1, 2, 3], greedy(8, stop_token_ids=[tok]))
    assert out.finish_reason == {"type": "stop", "matched": tok}
    assert out.output_ids == free.output_ids[: first + 1]


async def test_pause_abort_and_in_place(engine: TorchEngine) -> None:
    await engine.pause("in_place")
    task = asyncio.create_task(engine.generate([1, 2], greedy(5)))
    await asyncio.sleep(0.2)
    assert not task.done()  # paused: not admitted
    await engine.resume()
    assert len((await task).output_ids) == 5

    task = asyncio.create_task(engine.generate([1, 2], greedy(2000)))
    await asyncio.sleep(0.2)
    await engine.pause("abort")
    out = await task
    assert out.finish_reason["type"] == "abort" and len(out.output_ids) < 2000
    await engine.resume()


async def test_retract_keeps_tokens_and_recomputes_kv(engine: TorchEngine) -> None:
    alone = await engine.generate([1, 30, 31], greedy(800))
    task = asyncio.create_task(engine.generate([1, 30, 31], greedy(800)))
    await asyncio.sleep(0.1)
    assert not task.done()
    await engine.pause("retract")
    await asyncio.sleep(0.05)
    await engine.resume()
    out = await task
    assert out.output_ids == alone.output_ids
    assert max(abs(a - b) for a, b in zip(alone.logprobs, out.logprobs, strict=True)) < 1e-4


async def test_update_from_disk_changes_outputs_and_version(
    engine: TorchEngine, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from inference.tiny_model import make_tiny_model

    before = await engine.generate([1, 2, 3], greedy(10))
    v0 = engine.weight_version
    other = make_tiny_model(tmp_path / "seed1", seed=1)
    assert await engine.update_weights_from_disk(str(other), v0 + 1) == v0 + 1
    after = await engine.generate([1, 2, 3], greedy(10))
    assert after.output_ids != before.output_ids and after.weight_version == v0 + 1
    with pytest.raises(ValueError, match="safetensors"):
        await engine.update_weights_from_disk(str(tmp_path))
    assert engine.weight_version == v0 + 1
    assert await engine.update_weights_from_disk(str(tiny_model_dir), 7) == 7
    assert (await engine.generate([1, 2, 3], greedy(10))).output_ids == before.output_ids
    # Without a version the served version stays (SGLang's rule), the weights still change.
    assert await engine.update_weights_from_disk(str(other)) == 7
    assert (await engine.generate([1, 2, 3], greedy(10))).output_ids == after.output_ids
    await engine.update_weights_from_disk(str(tiny_model_dir))


@pytest.mark.parametrize(
    ("ids", "params", "message"),
    [
        ([], greedy(4), "empty"),
        ([1, 10**6], greedy(4), "out of range"),
        ([-1], greedy(4), "out of range"),
        ([1], greedy(5000), "context length"),
        ([1] * 4096, greedy(1), "no room"),
        ([1], greedy(4, stop_token_ids=[99999]), "stop_token_ids"),
    ],
)
async def test_bad_input(
    engine: TorchEngine, ids: list[int], params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await engine.generate(ids, params)
    assert len((await engine.generate([1], greedy(2))).output_ids) == 2


async def test_queue_limit_429(tiny_model_dir: Path) -> None:
    eng = TorchEngine(
        tiny_model_dir, TorchEngineConfig(max_queued_requests=2, max_running_requests=1)
    )
    try:
        await eng.pause("in_place")
        tasks = [asyncio.create_task(eng.generate([1], greedy(2))) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloaded):
            await eng.generate([1], greedy(2))
        await eng.resume()
        assert all(len(t.output_ids) == 2 for t in await asyncio.gather(*tasks))
    finally:
        eng.shutdown()


async def test_update_mid_request_is_reported(
    engine: TorchEngine, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from inference.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "seed2", seed=2)
    task = asyncio.create_task(engine.generate([1, 33], greedy(800)))
    await asyncio.sleep(0.1)
    assert not task.done()
    await engine.pause("retract")
    v0 = engine.weight_version
    v = await engine.update_weights_from_disk(str(other), v0 + 1)
    await engine.resume()
    out = await task
    n_before = out.version_events[0][1]
    assert out.weight_version == v and 0 < n_before < len(out.output_ids)
    meta = out.meta_info("r", return_logprob=False)
    # SGLang's shape: which version made which span of the output.
    assert meta["weight_version"] == str(v)
    assert meta["weight_versions"] == [
        {"version": str(v0), "start": 0, "end": n_before},
        {"version": str(v), "start": n_before, "end": len(out.output_ids)},
    ]
    await engine.update_weights_from_disk(str(tiny_model_dir), v + 1)


async def test_prompt_plus_budget_over_the_context_is_rejected(engine: TorchEngine) -> None:
    # As SGLang 0.5.21 (without --allow-auto-truncate): the whole budget must fit.
    prompt = [1] * (engine.context_length - 3)
    with pytest.raises(ValueError, match="exceeds the context length"):
        await engine.generate(prompt, greedy(4, ignore_eos=True))
    out = await engine.generate(prompt, greedy(3, ignore_eos=True))
    assert out.finish_reason == {"type": "length", "length": 3}
