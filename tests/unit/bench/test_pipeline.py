"""bench/pipeline.py's cost model, simulated engine and trainer backend, and its summary: fast
checks that keep the pipeline bench from rotting (the whole bench on a tiny shape:
tests/integration/test_pipeline_bench.py, slow)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import replace
from typing import Any

import pytest

from bench.pipeline import SHAPES, last_line
from bench.pipeline_model import (
    AFFINITY_HIT_FIRST,
    AFFINITY_HIT_LATER,
    ENGINE_LOAD,
    bounds,
    expected_sample,
    least_ideal_s,
    plan_split,
    rollout_steps,
    split_bounds,
    summarize,
)
from harness.sim.cost import Clock, EngineCost, Workload, retriever_p50_s
from harness.sim.engine import SimEngine
from harness.sim.trainer import SleepingBackend, TrainerCost
from tests.factories import make_trajectory
from trainer.config import TrainerConfig
from trainer.step import train_on


def test_the_engine_model_is_an_h100_serving_a_3b_model() -> None:
    c = EngineCost()
    alone = c.decode_tokens_per_s(1, 400)
    assert 150 < alone < 250  # one request: ~200 tok/s
    rates = [c.decode_tokens_per_s(b, 400) for b in (1, 16, 128, 512)]
    assert rates == sorted(rates) and rates[-1] < 30_000  # batching pays, then saturates
    assert c.decode_tokens_per_s(10_000, 400) == c.decode_tokens_per_s(c.max_running, 400)
    assert 1.5e6 < c.kv_tokens < 2e6
    assert c.push_s() == pytest.approx(6.18e9 / 8.71e9, rel=0.01)


def test_the_retriever_follows_the_measured_curve_then_saturates() -> None:
    assert retriever_p50_s(1) == pytest.approx(0.0216)
    assert retriever_p50_s(32) == pytest.approx(0.1414)
    assert 0.0478 < retriever_p50_s(20) < 0.1414
    assert retriever_p50_s(640) == pytest.approx(640 / 216.2)


def test_a_turn_is_cut_at_its_budget() -> None:
    rng = random.Random(0)
    draws = [Workload().draw(rng, 100) for _ in range(2000)]
    assert all(1 <= n <= 100 for n, _, _ in draws)
    assert all(cut == (n == 100) for n, _, cut in draws)
    assert 0.55 < sum(s for _, s, _ in draws) / len(draws) < 0.65


def test_expected_work_split_and_bounds_of_slime_recipe() -> None:
    shape, cost = SHAPES["slime8"], EngineCost()
    work = expected_sample(shape, Workload(), prompt_tokens=156, obs_tokens=459)
    assert 1.5 < work.turns < 1.7  # at most 2 calls; a search on the first with p = 0.6
    split = plan_split(shape, work, cost, 6879.0)
    assert sum(split) == 8 and min(split) >= 1
    # Engines planned at ENGINE_LOAD of capacity: with the prefix cache (the bench's default),
    # more of them than the least ideal bound's split (1 engine: its rollout's latency would
    # outlast a trainer step; measured 7.1 s against 5.1 s with 2, docs/pipeline-bench.md).
    hit = work.prefix_hit
    planned = plan_split(shape, work, cost, 6879.0, hit)
    options = split_bounds(shape, work, cost, 6879.0, hit)
    least = min(options, key=lambda n: options[n].ideal_s)
    assert (least, planned) == (1, (2, 6))
    assert options[2].engine_s <= ENGINE_LOAD * options[2].trainer_s
    assert least_ideal_s(shape, work, cost, 6879.0, hit) == options[least].ideal_s
    b = bounds(60_000, 150_000, 400, 170_000, 256, (2, 6), cost, 6879.0)
    assert b.trainer_s == pytest.approx(170_000 / (6 * 6879) + cost.push_s())
    assert b.ideal_s == max(b.engine_s, b.trainer_s)
    assert b.serial_s == b.engine_s + b.trainer_s


def test_the_affinity_cache_serves_what_the_measured_hit_rates_say() -> None:
    # One call per sample (a slime shape with max_turns 1): only a group's shared prompt is
    # cacheable, (size - 1) / size of it, at the measured first-turn rate.
    one = replace(SHAPES["slime8"], max_turns=1)
    work = expected_sample(one, Workload(), prompt_tokens=100, obs_tokens=50)
    assert work.prefill == pytest.approx(100)
    assert work.cached == pytest.approx(AFFINITY_HIT_FIRST * 100 * 7 / 8)
    # Two calls: the second reuses the prompt and the first turn's tokens, not the observation.
    two = expected_sample(SHAPES["slime8"], Workload(), prompt_tokens=100, obs_tokens=50)
    second_calls = two.turns - 1
    assert 0.4 < two.prefix_hit < 1.0 and second_calls > 0
    assert two.cached > work.cached + AFFINITY_HIT_LATER * 100 * second_calls


async def test_the_engine_batches_pauses_and_aborts_in_simulated_time() -> None:
    clock = Clock(20.0)  # 1 simulated s = 50 ms
    cost = EngineCost(
        step_fixed_s=0.01, step_per_seq_s=0.0, step_per_kv_token_s=0.0, prefill_tokens_per_s=1e12
    )
    engine = SimEngine(cost, clock)
    runner = asyncio.create_task(engine.run())
    try:
        t0 = clock.now()
        done = await asyncio.gather(engine.generate(50, 10), engine.generate(50, 10))
        took = clock.now() - t0
        assert [d[:2] for d in done] == [(50, "done"), (50, "done")]
        assert 0.45 < took < 0.8  # batched: 50 iterations of 10 ms, not 100
        assert engine.stats.tokens == 100 and engine.stats.requests == 2
        assert 0.45 < engine.stats.busy_s < 0.8

        t0 = clock.now()
        call = asyncio.create_task(engine.generate(50, 10))
        await asyncio.sleep(0.005)
        engine.pause("retract")
        await asyncio.sleep(0.03)  # 0.6 simulated s paused
        engine.resume(recompute=True)
        assert (await call)[:2] == (50, "done")
        assert clock.now() - t0 > 1.0  # 0.5 s of decoding + the pause

        call = asyncio.create_task(engine.generate(50, 10))
        await asyncio.sleep(0.01)  # ~20 of 50 tokens
        engine.pause("abort")
        n, how, *_ = await call
        assert how == "abort" and 0 < n < 50
        assert engine.stats.aborted_tokens == n
        engine.resume(recompute=False)
    finally:
        runner.cancel()


def test_the_sleeping_backend_runs_the_grpo_core_for_its_modelled_time() -> None:
    cfg = TrainerConfig()
    trajs = [
        make_trajectory(f"t-{i}", group_id=f"g-{i // 4}", reward=float(i % 2), seed=i)
        for i in range(8)
    ]
    backend = SleepingBackend(cfg, TrainerCost(tokens_per_s_per_gpu=1000.0, time_scale=100.0))
    start = time.perf_counter()
    metrics = train_on(trajs, backend, cfg)
    tokens = metrics["train_tokens"]
    assert tokens == 8 * (6 + 12)
    assert backend.slept_s == pytest.approx(tokens / 1000.0)
    assert time.perf_counter() - start >= tokens / 1000.0 / 100.0
    assert "loss" in metrics and backend.optimizer_steps == 1
    assert [n for n, _ in backend.named_tensors()] == ["sim.weight"]


def _snap(step: int, now: float, busy: float, tokens: int, lag: int) -> tuple[Any, ...]:
    metrics = {
        "samples": 8.0,
        "response_length/mean": 10.0,
        "loss_mask/observation_fraction": 0.5,
        "time/step_s": 2.0,
        "time/wait_data_s": 0.5,
        "train_tokens": 200.0,
        f"staleness/count_{lag}": 8.0,
    }
    engine = {
        "busy_s": busy,
        "tokens": tokens,
        "prefill_computed": 100 * step,
        "prefill_cached": 0,
        "requests": 10 * step,
    }
    return metrics, {"now": now, "push_s": 0.5 * step, "engines": [engine, engine]}, step, now / 2


def test_the_summary_of_a_run() -> None:
    snaps = [_snap(i, 4.0 * i, 3.0 * i, 50 * i, lag=i % 2) for i in range(1, 6)]
    r = summarize("async1", snaps, warmup=1, split=(2, 6), scale=2.0)
    assert r.steps == 3 and r.step_s == pytest.approx(4.0)
    assert r.engine_busy == pytest.approx(0.75)  # 2 engines x 3 s busy per 4 s
    assert r.trainer_busy == pytest.approx(3 * 1.5 * 2.0 / 12.0)
    assert r.staleness == {0: 8.0, 1: 16.0}  # steps 3, 4, 5
    assert r.generated == pytest.approx(100.0) and r.discarded == pytest.approx(60.0)
    assert r.push_s == pytest.approx(0.5)
    r.bounds = bounds(r.generated, r.prefill, r.context, r.train_tokens, 8, (2, 6),
                      EngineCost(), 6879.0)  # fmt: skip
    r.rollout_step_s = 3.0
    line = last_line("tiny", {"sync": r, "async1": r}, 1.0)
    assert "colocated_step_s=" in last_line("tiny", {"colocated": r}, 1.0)  # alone, too
    keys = [kv.split("=")[0] for kv in line.split()]
    values = dict(kv.split("=") for kv in line.split())
    # sync's bound: its measured rollout step (tail included) plus train and push
    bound = r.rollout_step_s + r.bounds.trainer_s
    assert float(values["sync_bound_s"]) == pytest.approx(bound, abs=0.01)
    assert float(values["sync_vs_bound"]) == pytest.approx(r.step_s / bound, abs=0.01)
    assert keys[:7] == [
        "sync_step_s", "async_step_s", "speedup", "engine_busy", "trainer_busy", "ideal_step_s",
        "efficiency",
    ]  # fmt: skip


def test_rollout_step_times_come_from_the_orchestrators_step_records() -> None:
    def rec(step: int, per_s: float) -> str:
        return json.dumps({"msg": "step done", "step": step, "samples": 8.0,
                           "samples_per_s": per_s, "turns_mean": 2.0, "searches_mean": 1.0,
                           "truncation_rate": 0.25})  # fmt: skip

    lines = [rec(0, 1.0), '{"msg": "waiting for weights"}', rec(1, 4.0), rec(2, 2.0), rec(3, 4.0)]
    out = rollout_steps(lines, warmup=1, scale=2.0)
    assert out["rollout_step_s"] == pytest.approx(2 * 2.0)  # median of 2, 4, 2 s, x2
    assert out["turns_mean"] == 2.0 and out["truncation_rate"] == 0.25
    assert rollout_steps(["nothing"], 0, 1.0) == {}
