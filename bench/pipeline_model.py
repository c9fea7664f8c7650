"""The arithmetic of `bench/pipeline.py`, apart from its processes: the shapes, the expected
work of a sample (a Monte Carlo over the workload model), the split of a cluster's GPUs between
engines and trainer, the ideal bound, and the summary of a measured run."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from harness.sim.cost import MEASURED_TOKENS_PER_S, R1_DISTILL_15B, EngineCost, Workload


@dataclass(frozen=True)
class Shape:
    name: str
    prompts: int
    group_size: int
    gpus: int
    semantics: str  # slime: max_turns generation calls; original: max_turns searches + answer
    max_turns: int
    turn_tokens: int  # in ids (each `engine.token_unit` real tokens)
    response_tokens: int
    obs_tokens: int | None
    time_scale: float
    engine: EngineCost = field(default_factory=EngineCost)
    workload: Workload = field(default_factory=Workload)
    trainer_tok_s: float = MEASURED_TOKENS_PER_S  # per trainer GPU, real tokens
    engine_gpus: int | None = None  # a fixed split (None: plan_split's)
    modes: tuple[str, ...] | None = None  # the bench's default modes for this shape
    staleness: int = 1  # the `async` mode's max staleness

    @property
    def samples(self) -> int:
        return self.prompts * self.group_size

    @property
    def token_unit(self) -> int:
        return self.engine.token_unit


# AReaL's published setting (sources: [v0.2] blog/AReaL_v0_2.md, [v0.3] blog/AReaL_v0_3.md,
# [cfg] examples/legacy/configs/v0.2-qwen2-math/1.5B-distill/ppo-1.5B-distill-gpus-128.yaml,
# [bench] benchmark/verl_v0_3_0_post1_76084d3/{build_cmd.py,areal_config.yaml}, all in
# inclusionAI/AReaL at 820ca49; the paper is arXiv 2505.24298). Its 2.77x: DeepSeek-R1-Distill-
# Qwen-1.5B on 16 nodes of 8 H800, 1,000 PPO steps in 41.0 h synchronous, 14.8 h asynchronous
# ([v0.3] Table 2: 41.0 / 14.8 = 2.77).
AREAL_RATIO = 2.77
AREAL_GPUS = 16 * 8  # [v0.3] Table 2: 16 nodes; [cfg] n_gpus_per_node 8
AREAL_PROMPTS, AREAL_GROUP = 512, 16  # [v0.2] "512 questions ... 16 responses"; [cfg], [bench]
AREAL_MAX_NEW_TOKENS = 27648  # [cfg] ppo.gen.max_new_tokens ([v0.2]: "27K ... truncation <5%")
AREAL_INFERENCE_SHARE = 3 / 4  # [bench] build_cmd.py: n_sglang_gpus = n_nodes * 8 // 4 * 3
AREAL_STALENESS = 4  # [bench] areal_config.yaml max_head_offpolicyness ([v0.3]: eta <= 4)
AREAL_MEM_FRACTION = 0.8  # [cfg], [bench] sglang.mem_fraction_static
# Ours, not AReaL's: an id stands for 64 tokens (a 27K generation is 432 ids); lengths spread as
# our workload's turns (log-normal sigma 0.7) with the median that cuts 5% at the budget ([v0.2]
# reports truncation below 5%): 27,648 x exp(-1.645 x 0.7) = 8,740 tokens, mean 11,170.
AREAL_TOKEN_UNIT = 64
AREAL_SIGMA = 0.7
AREAL_MEDIAN_TOKENS = AREAL_MAX_NEW_TOKENS * math.exp(-1.645 * AREAL_SIGMA)
# The trainer: our measured 6,879 tok/s/GPU (Qwen2.5-3B, 10 x params FLOPs a token with the
# reference model) at the same MFU for 1.78e9 parameters and 8 x params a token (AReaL's kl_ctl
# is 0: no reference model; recompute_logprob: the old logprobs' forward). Long contexts'
# attention FLOPs are left out: a fast bound on the trainer.
AREAL_TRAINER_TOK_S = MEASURED_TOKENS_PER_S * (3.09e9 * 10) / (R1_DISTILL_15B.params * 8)
# 1/16 of the cluster with the same load per GPU: 32 prompts x 16 on 8 GPUs (6 engines, 2
# trainer GPUs) hold 512 / 6 = 85 samples per engine and 256 per trainer GPU, as 8,192 samples
# on 96 + 32 GPUs do; a step's work per GPU, so its time, is AReaL's.
AREAL_SCALE = 16
AREAL = Shape(
    "areal", AREAL_PROMPTS // AREAL_SCALE, AREAL_GROUP, gpus=AREAL_GPUS // AREAL_SCALE,
    semantics="slime", max_turns=1, turn_tokens=AREAL_MAX_NEW_TOKENS // AREAL_TOKEN_UNIT,
    response_tokens=AREAL_MAX_NEW_TOKENS // AREAL_TOKEN_UNIT, obs_tokens=None, time_scale=10.0,
    engine=EngineCost.serving(R1_DISTILL_15B, mem_fraction_static=AREAL_MEM_FRACTION,
                              token_unit=AREAL_TOKEN_UNIT),
    workload=Workload(p_search=0.0, turn_median_tokens=AREAL_MEDIAN_TOKENS / AREAL_TOKEN_UNIT,
                      turn_sigma=AREAL_SIGMA),
    trainer_tok_s=AREAL_TRAINER_TOK_S,
    engine_gpus=round(AREAL_GPUS // AREAL_SCALE * AREAL_INFERENCE_SHARE),
    modes=("colocated", f"async{AREAL_STALENESS}"),
)  # fmt: skip


@dataclass(frozen=True)
class SampleWork:
    """Mean work of one sample."""

    generated: float  # model tokens decoded
    prefill: float  # context tokens prefilled (before prefix-cache hits)
    train: float  # prompt + response tokens through the trainer
    turns: float
    context: float  # mean context of a generate call
    # Context tokens served from the prefix cache under affinity routing (a group's calls on
    # one engine) at the hit rates measured in issue 28 (AFFINITY_HIT_*).
    cached: float = 0.0

    @property
    def prefix_hit(self) -> float:
        """The share of prefilled context the cache serves under affinity routing."""
        return self.cached / self.prefill if self.prefill else 0.0


# Measured with affinity routing (docs/benchmarks.md, "Prefix cache and affinity routing"; our
# engine and real SGLang): later turns 0.998 of the previous call's input and output served
# from cache; first turns 0.797 of a group's prompt for groups of 5, i.e. 0.996 of the
# (size - 1) / size that group-mates can share (the first sample computes it).
AFFINITY_HIT_LATER = 0.998
AFFINITY_HIT_FIRST = 0.797 / 0.8


def expected_sample(
    shape: Shape, workload: Workload, prompt_tokens: int, obs_tokens: int, n: int = 4000
) -> SampleWork:
    """The orchestrator's turn loop (`orchestrator.rollout`) over the workload's draws, in real
    tokens (a generated id is `shape.token_unit` of them)."""
    rng = random.Random(1)
    unit = shape.token_unit
    obs = min(obs_tokens, shape.obs_tokens or obs_tokens)
    calls = shape.max_turns + (1 if shape.semantics == "original" else 0)
    gen = pre = train = turns = cached = 0.0
    shared_prompt = prompt_tokens * (shape.group_size - 1) / shape.group_size
    for _ in range(n):
        resp = reusable = 0
        for call in range(calls):
            room = min(shape.turn_tokens, shape.response_tokens - resp // unit)
            if room <= 0:
                break
            tokens, search, cut = workload.draw(rng, room)
            tokens *= unit
            pre += prompt_tokens + resp
            cached += (
                AFFINITY_HIT_FIRST * shared_prompt
                if call == 0
                else AFFINITY_HIT_LATER * (prompt_tokens + reusable)
            )
            turns += 1
            resp += tokens
            gen += tokens
            reusable = resp  # the next call reuses this one's input and output
            if cut or not search or call == calls - 1:
                break
            resp = min(resp + obs, shape.response_tokens)
        train += prompt_tokens + resp
    return SampleWork(gen / n, pre / n, train / n, turns / n, pre / max(turns, 1), cached / n)


@dataclass(frozen=True)
class Bounds:
    engine_s: float  # the rollout's work per step over the engines' capacity
    trainer_s: float  # training + push per step over the trainer's capacity
    push_s: float

    @property
    def ideal_s(self) -> float:
        """Async: the busier resource's work per step."""
        return max(self.engine_s, self.trainer_s)

    @property
    def serial_s(self) -> float:
        """Sync: rollout, then train and push, with perfect batching (no long tail)."""
        return self.engine_s + self.trainer_s


def bounds(
    generated: float, prefill: float, context: float, train_tokens: float, samples: int,
    split: tuple[int, int], cost: EngineCost, trainer_tok_s: float,
) -> Bounds:  # fmt: skip
    """Per step: `generated` decoded and `prefill` prefilled tokens (uncached) over `split[0]`
    engines at the batch the step offers them; `train_tokens` over `split[1]` trainer GPUs.
    A decoding request holds its call's `context` and, on average, half of what it generates
    (a sample's generation counted as one call's: exact for one call, a little high for more;
    it sets the KV read, which long generations dominate)."""
    engines, trainers = split
    batch = max(1, min(cost.max_running, samples // engines))
    held = context + generated / max(samples, 1) / 2
    decode_s = generated / (engines * cost.decode_tokens_per_s(batch, held))
    prefill_s = prefill / (engines * cost.prefill_tokens_per_s)
    push = cost.push_s()
    return Bounds(decode_s + prefill_s, train_tokens / (trainers * trainer_tok_s) + push, push)


# How loaded engines can run and still deliver a step within the trainer's step: continuous
# batching fills them only while a step's slower samples are still running, so a split whose
# engines would need full load leaves the trainer waiting on the rollout's tail. Measured at
# capacity 0.49-0.64 in the async slime8 runs of docs/pipeline-bench.md (steps overlapping).
ENGINE_LOAD = 0.6


def split_bounds(
    shape: Shape, work: SampleWork, cost: EngineCost, trainer_tok_s: float, hit: float = 0.0
) -> dict[int, Bounds]:
    """The bounds of every split of `shape.gpus` (one GPU per engine), by engine count, with
    `hit` of the prefilled context served from the prefix cache."""
    return {
        engines: bounds(
            shape.samples * work.generated,
            shape.samples * work.prefill * (1 - hit),
            work.context,
            shape.samples * work.train,
            shape.samples,
            (engines, shape.gpus - engines),
            cost,
            trainer_tok_s,
        )
        for engines in range(1, shape.gpus)
    }


def plan_split(
    shape: Shape, work: SampleWork, cost: EngineCost, trainer_tok_s: float, hit: float = 0.0
) -> tuple[int, int]:
    """(engines, trainer GPUs): the least step once engines run at ENGINE_LOAD of capacity.
    (The least ideal bound alone picks too few engines where the batch is small: the rollout's
    latency, not its work, then sets the step.)"""
    if shape.engine_gpus is not None:
        return shape.engine_gpus, shape.gpus - shape.engine_gpus
    options = split_bounds(shape, work, cost, trainer_tok_s, hit)
    engines = min(
        options, key=lambda n: max(options[n].engine_s / ENGINE_LOAD, options[n].trainer_s)
    )
    return engines, shape.gpus - engines


def least_ideal_s(
    shape: Shape, work: SampleWork, cost: EngineCost, trainer_tok_s: float, hit: float = 0.0
) -> float:
    """The ideal bound of the best split of the cluster, whichever split a run uses."""
    bounds_ = split_bounds(shape, work, cost, trainer_tok_s, hit)
    return min(b.ideal_s for b in bounds_.values())


@dataclass
class ModeResult:
    mode: str
    steps: int  # measured (after the warm-up)
    step_s: float
    samples_per_s: float
    engine_busy: float  # engine-seconds decoding or prefilling / engine-seconds
    trainer_busy: float  # (trainer step - its wait for data) / time
    push_s: float  # simulated transfer per step
    wait_data_s: float  # the trainer's wait for data per step
    staleness: dict[int, float]
    generated: float  # tokens per step
    discarded: float  # generated, never trained, per step
    prefill: float  # prefilled tokens per step
    context: float  # mean context of a generate call
    train_tokens: float
    cpu_share: float  # orchestrator + trainer CPU-seconds per real second
    bounds: Bounds | None = field(default=None)
    # From the orchestrator's "step done" logs (steps after the warm-up): how long a rollout
    # step took, from its first claim to its last group published, and what it held.
    rollout_step_s: float = float("nan")
    turns_mean: float = float("nan")
    searches_mean: float = float("nan")
    truncation_rate: float = float("nan")
    search_s: float = float("nan")  # mean simulated search latency (the retriever's own count)
    prefix_hit: float = 0.0  # share of the prefilled context the engines' caches served


def rollout_steps(log_lines: list[str], warmup: int, scale: float) -> dict[str, float]:
    """Median rollout step time (simulated s) and means of the orchestrator's "step done"
    records after `warmup` steps."""
    import json
    import statistics

    steps = []
    for line in log_lines:
        if '"step done"' in line:
            rec = json.loads(line)
            if rec.get("step", 0) >= warmup and rec.get("samples_per_s"):
                steps.append(rec)
    if not steps:
        return {}
    return {
        "rollout_step_s": statistics.median(r["samples"] / r["samples_per_s"] for r in steps)
        * scale,
        "turns_mean": statistics.fmean(r["turns_mean"] for r in steps),
        "searches_mean": statistics.fmean(r["searches_mean"] for r in steps),
        "truncation_rate": statistics.fmean(r["truncation_rate"] for r in steps),
    }


def summarize(
    mode: str, snaps: list[tuple[dict[str, Any], dict[str, Any], float, float]], warmup: int,
    split: tuple[int, int], scale: float, unit: int = 1,
) -> ModeResult:  # fmt: skip
    """`snaps`: per trainer step (its metrics line, the engines' stats read when it appeared,
    CPU seconds of the processes, real time). The window starts after `warmup` steps. Token
    counts come out in real tokens (a generated id is `unit` of them)."""
    warm = max(0, min(warmup, len(snaps) - 2))
    first, last = snaps[warm], snaps[-1]
    window = [m for m, _, _, _ in snaps[warm + 1 :]]
    n = len(window)
    span = last[1]["now"] - first[1]["now"]

    def delta(key: str) -> float:
        return sum(e[key] for e in last[1]["engines"]) - sum(e[key] for e in first[1]["engines"])

    requests = max(delta("requests"), 1.0)
    trained = unit * sum(
        m["samples"] * m["response_length/mean"] * (1 - m["loss_mask/observation_fraction"])
        for m in window
    )
    hist: dict[int, float] = {}
    for m in window:
        for k, v in m.items():
            if k.startswith("staleness/count_"):
                lag = int(k.removeprefix("staleness/count_"))
                hist[lag] = hist.get(lag, 0.0) + v
    generated = delta("tokens")
    return ModeResult(
        mode=mode,
        steps=n,
        step_s=span / n,
        samples_per_s=sum(m["samples"] for m in window) / span,
        engine_busy=delta("busy_s") / (span * split[0]),
        trainer_busy=sum(m["time/step_s"] - m["time/wait_data_s"] for m in window) * scale / span,
        push_s=(last[1]["push_s"] - first[1]["push_s"]) / n,
        wait_data_s=sum(m["time/wait_data_s"] for m in window) * scale / n,
        staleness=dict(sorted(hist.items())),
        generated=generated / n,
        discarded=max(generated - trained, 0.0) / n,
        prefill=delta("prefill_computed") / n,
        context=(delta("prefill_computed") + delta("prefill_cached")) / requests,
        train_tokens=(sum(m["train_tokens"] for m in window) + trained * (unit - 1) / unit) / n,
        cpu_share=(last[2] - first[2]) / max(last[3] - first[3], 1e-9),
        prefix_hit=delta("prefill_cached") / max(delta("prefill_computed")
                                                 + delta("prefill_cached"), 1.0),
    )  # fmt: skip
