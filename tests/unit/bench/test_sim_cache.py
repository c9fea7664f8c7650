"""The simulated engines' prefix caches (harness.sim): LRU blocks, hits decided by routing, a
flush on new weights; and bench/pipeline.py's AReaL shape against its sources."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from bench.pipeline import MODES, SHAPES, last_line
from bench.pipeline_model import (
    AREAL_RATIO,
    AREAL_SCALE,
    ModeResult,
    bounds,
)
from harness.sim.cost import R1_DISTILL_15B, Clock, EngineCost, Workload
from harness.sim.engine import Cluster, SimEngine
from harness.sim.prefix_cache import SimulatedPrefixCache


def test_the_cache_matches_whole_blocks_of_a_cached_prefix() -> None:
    cache = SimulatedPrefixCache(capacity=100, block=4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9])  # two whole blocks; the 9 is not kept
    assert cache.size == 8
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 8
    assert cache.match([1, 2, 3, 4, 5, 6, 0, 8]) == 4  # the second block differs
    assert cache.match([0, 2, 3, 4, 5, 6, 7, 8]) == 0  # a block hits only after its prefix
    assert cache.match([1, 2, 3]) == 0  # no whole block


def test_the_cache_evicts_the_least_recently_used_leaves_first() -> None:
    cache = SimulatedPrefixCache(capacity=12, block=4)  # three blocks
    cache.insert([1, 1, 1, 1, 2, 2, 2, 2])  # a: root, leaf
    cache.insert([1, 1, 1, 1, 3, 3, 3, 3])  # b shares a's root: 3 blocks held
    assert cache.size == 12
    cache.insert([9, 9, 9, 9])  # one must go: a's leaf (the root was touched after it)
    assert cache.match([1, 1, 1, 1, 2, 2, 2, 2]) == 4
    assert cache.match([1, 1, 1, 1, 3, 3, 3, 3]) == 8
    assert cache.match([9, 9, 9, 9]) == 4
    cache.shrink(4)  # memory taken back: the least recently used go
    assert cache.size == 4 and cache.match([9, 9, 9, 9]) == 4
    assert SimulatedPrefixCache(capacity=0).match([1] * 32) == 0


def _serve(routing: str, engines: int = 3) -> dict[str, float]:
    """Two groups of two samples, two calls each (all first calls, then all second ones), on
    `engines` engines: each call prefills through its engine's cache, then leaves its prompt
    and output there, as a finished request does. Hit rates by turn."""
    clock, cost = Clock(1.0), EngineCost()
    cluster = Cluster([SimEngine(cost, clock) for _ in range(engines)], clock, cost, Workload(),
                      routing=routing, _rr=itertools.cycle(range(engines)))  # fmt: skip
    prompts = {g: [100 * g + i for i in range(32)] for g in range(2)}  # two blocks each
    context = {(g, s): list(prompts[g]) for g in range(2) for s in range(2)}
    hit = {"first": 0, "later": 0}
    total = {"first": 0, "later": 0}
    for turn in ("first", "later"):
        for (g, s), ids in context.items():
            engine = cluster.route(f"g{g}")
            hit[turn] += engine.prefill(ids)
            total[turn] += len(ids)
            out = [1000 + 100 * (2 * g + s) + 16 * (turn == "later") + i for i in range(16)]
            engine.cache.insert([*ids, *out])
            context[g, s] = [*ids, *out]
    return {t: hit[t] / total[t] for t in hit}


def test_routing_decides_the_hit_rate() -> None:
    # Affinity: both groups' keys first meet idle engines and take engine 0; each group's
    # second sample finds the 32-token prompt its mate left (2 of 4 first calls: 64 / 128), and
    # every second call finds its own 48-token conversation (192 / 192).
    assert _serve("affinity") == {"first": 0.5, "later": 1.0}
    # Round robin over 3 engines: first calls go to e0, e1, e2, e0, no engine holds their
    # group's prompt yet (0 / 128); second calls go to e1, e2, e0, e1: g0's first sample meets
    # its mate's prompt on e1 (32), g1's first sample meets its mate's on e0 (32), the others
    # nothing (64 / 192).
    assert _serve("round_robin") == {"first": 0.0, "later": pytest.approx(1 / 3)}
    with pytest.raises(ValueError, match="routing"):
        _serve("random")


def test_new_weights_flush_every_engines_cache() -> None:
    clock, cost = Clock(1.0), EngineCost()
    cluster = Cluster([SimEngine(cost, clock) for _ in range(2)], clock, cost, Workload())
    for e in cluster.engines:
        e.cache.insert(list(range(32)))
    cluster.set_version(0)  # the same version: nothing flushed
    assert all(e.cache.match(list(range(32))) == 32 for e in cluster.engines)
    cluster.set_version(1)
    assert all(e.cache.size == 0 for e in cluster.engines)
    assert EngineCost(prefix_cache_tokens=0).prefix_cache_tokens == 0
    assert SimEngine(EngineCost(prefix_cache_tokens=0), clock).prefill(list(range(32))) == 0


async def test_a_finished_request_leaves_its_conversation_for_the_next_call() -> None:
    clock = Clock(1000.0)
    cost = EngineCost(step_fixed_s=0.001, step_per_seq_s=0.0, step_per_kv_token_s=0.0)
    engine = SimEngine(cost, clock)
    runner = asyncio.create_task(engine.run())
    try:
        prompt, out = list(range(32)), list(range(500, 516))
        *_, cached = await engine.generate(16, 32, prompt=prompt, output=out)
        assert cached == 0
        *_, cached = await engine.generate(16, 48, prompt=[*prompt, *out], output=out)
        assert cached == 48
        assert engine.stats.prefill_cached == 48 and engine.stats.prefill_computed == 32
        assert engine.stats.finished == 2
    finally:
        runner.cancel()


async def test_an_abort_caches_what_was_prefilled_only() -> None:
    clock = Clock(1.0)
    cost = EngineCost(step_fixed_s=0.01, step_per_seq_s=0.0, step_per_kv_token_s=0.0,
                      max_running=1)  # fmt: skip
    engine = SimEngine(cost, clock)
    runner = asyncio.create_task(engine.run())
    try:
        running, waiting = list(range(32)), list(range(100, 132))
        calls = [asyncio.create_task(engine.generate(1000, 32, prompt=ids, output=[7] * 16))
                 for ids in (running, waiting)]  # fmt: skip
        await asyncio.sleep(0.05)  # the first admitted, the second waiting for a place
        engine.pause("abort")
        (n, how, *_), (m, how_waiting, *_) = [await c for c in calls]
        assert (how, how_waiting, m) == ("abort", "abort", 0) and n < 1000
        assert engine.cache.match(running) == 32 and engine.cache.match(waiting) == 0
    finally:
        runner.cancel()


def test_the_areal_shape_is_areals_published_setting() -> None:
    shape = SHAPES["areal"]
    # 512 prompts x 16 on 16 nodes of 8 GPUs, 3/4 of them SGLang engines, at 1/16: the same
    # samples per engine GPU and per trainer GPU.
    assert (shape.prompts * AREAL_SCALE, shape.group_size) == (512, 16)
    assert shape.gpus * AREAL_SCALE == 128 and shape.engine_gpus == 6
    assert shape.samples / shape.engine_gpus == pytest.approx(512 * 16 / 96)
    assert shape.samples / (shape.gpus - shape.engine_gpus) == 512 * 16 / 32
    # One generation of up to 27,648 tokens (ids of 64 tokens), about 5% of them cut.
    assert shape.max_turns == 1 and shape.turn_tokens * shape.token_unit == 27648
    rng = random.Random(0)
    draws = [shape.workload.draw(rng, shape.turn_tokens) for _ in range(20_000)]
    assert 0.04 < sum(cut for _, _, cut in draws) / len(draws) < 0.06
    assert not any(search for _, search, _ in draws)
    # Colocated sync against async at AReaL's max staleness 4; AReaL's 41.0 h / 14.8 h.
    assert shape.modes == ("colocated", "async4") and MODES["async4"] == ("async", 4)
    assert round(41.0 / 14.8, 2) == AREAL_RATIO
    # DeepSeek-R1-Distill-Qwen-1.5B served at mem_fraction_static 0.8 on an 80 GB GPU.
    kv = 28 * 2 * 2 * 128 * 2
    assert shape.engine.kv_tokens == int((80e9 * 0.8 - 2 * R1_DISTILL_15B.params) / kv)
    assert shape.engine.push_bytes == 2 * R1_DISTILL_15B.params
    # The trainer at our measured MFU: 6,879 tok/s x (3.09e9 x 10) / (1.78e9 x 8).
    assert shape.trainer_tok_s == pytest.approx(14_927, rel=1e-3)


def test_the_last_line_ends_with_the_ratio_beside_arealss() -> None:
    r = ModeResult("async4", 3, 50.0, 10.0, 0.9, 0.9, 0.4, 0.0, {}, 1e6, 0.0, 1e4, 156.0, 1e6,
                   0.5)  # fmt: skip
    r.bounds = bounds(1e6, 1e4, 156, 1e6, 512, (6, 2), EngineCost(), 6879.0)
    colocated = ModeResult("colocated", 3, 125.0, 4.0, 0.5, 0.4, 0.4, 0.0, {}, 1e6, 0.0, 1e4,
                           156.0, 1e6, 0.5, bounds=r.bounds)  # fmt: skip
    line = last_line("areal", {"colocated": colocated, "async4": r}, 40.0, AREAL_RATIO)
    pairs = dict(kv.split("=") for kv in line.split())
    assert line.split()[-2:] == ["ratio=2.50", "areal_ratio=2.77"]
    assert pairs["async_mode"] == "async4" and pairs["speedup_vs_colocated"] == "2.50"
    assert "ratio=" not in last_line("tiny", {"async4": r}, 40.0)
