"""The one cost model of the simulated cluster (`harness.sim`): pure numbers, no I/O.

Every default names its source here and in docs/scale.md ("The pipeline bench's cost model").
Times are simulated seconds; `Clock` maps them onto real time (`time_scale` simulated seconds
per real second), so a cluster step of a minute can run in seconds on a CPU machine. A token
id may stand for `token_unit` real tokens (`EngineCost.token_unit`, `TrainerCost.token_unit`):
long reasoning generations (AReaL's 27K tokens) then cost what they would without thousands of
ids per sample crossing HTTP and Redis on a CPU machine. (Only generated ids are scaled, so a
unit above 1 fits single-call shapes, where a call's context is its prompt.)
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass

H100_HBM_BYTES_PER_S = 3.35e12  # H100 SXM datasheet
H100_BF16_FLOPS = 989e12  # H100 SXM dense bf16 datasheet (also the MFU base of bench/trainer_step)
# (An H800, AReaL's GPU, is an H100 SXM with NVLink cut to 400 GB/s: same HBM and FLOPS.)


@dataclass(frozen=True)
class ModelSpec:
    """What a model's serving cost depends on (from its config.json)."""

    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2  # (K, V) x bf16


# Qwen2.5-3B (its config.json): 3.09e9 parameters, 36 layers, 2 KV heads of 128 dims.
QWEN25_3B = ModelSpec(3.09e9, 36, 2, 128)
# DeepSeek-R1-Distill-Qwen-1.5B, AReaL's 1.5B (its config.json: 28 layers, 2 KV heads of 128
# dims, untied embeddings: 1.78e9 parameters).
R1_DISTILL_15B = ModelSpec(1.78e9, 28, 2, 128)
PARAMS = QWEN25_3B.params
# The trainer's rate (a whole GRPO step: old and reference logprobs, forward, backward,
# optimizer, per GPU): the Megatron backend's measured rate for Qwen2.5-3B at slime's batch on
# one H100 (docs/benchmarks.md, "Trainer on a GPU"; MFU 0.22 over 10 x params FLOPs a token).
MEASURED_TOKENS_PER_S = 6879.0
KV_BYTES_PER_TOKEN = QWEN25_3B.kv_bytes_per_token


@dataclass(frozen=True)
class EngineCost:
    """One SGLang engine (TP 1) serving Qwen2.5-3B in bf16 on one H100; a decode iteration
    takes `fixed + per_seq * B + per_kv_token * (context tokens held)`, every running request
    gains one token per iteration; a prefill stalls decoding for its uncached tokens."""

    # Weight read (6.2 GB at ~70% of 3.35 TB/s = 2.6 ms) plus scheduling / kernel launch
    # overhead under CUDA graphs: a 3B model decodes ~200 tok/s alone.
    step_fixed_s: float = 0.005
    # Matmul compute per sequence: 2 x 3.09e9 FLOP at ~40% of 989 TFLOP/s = 16 us, + sampling.
    step_per_seq_s: float = 2.0e-5
    # KV read per context token held: 36,864 B at ~70% of 3.35 TB/s.
    step_per_kv_token_s: float = KV_BYTES_PER_TOKEN / (0.7 * H100_HBM_BYTES_PER_S)
    # Prefill: 2 x 3.09e9 FLOP per token at ~40% MFU (the trainer's measured MFU is 0.22 with
    # backward and recompute; a forward-only prefill runs hotter).
    prefill_tokens_per_s: float = 0.4 * H100_BF16_FLOPS / (2 * PARAMS)
    # SGLang's --max-running-requests (its default depends on memory; 512 set here).
    max_running: int = 512
    # KV pool: 80 GB x 0.88 (SGLang's mem_fraction_static for an 80 GB card) - 6.2 GB weights.
    kv_tokens: int = int((80e9 * 0.88 - 2 * PARAMS) / KV_BYTES_PER_TOKEN)
    # Each engine's prefix cache (`harness.sim.prefix_cache`): None = what of the KV pool
    # running requests do not hold (SGLang's radix cache lives in the pool); 0 = no cache.
    # Which engine a session's calls land on (the routing) decides its hits.
    prefix_cache_tokens: int | None = None
    # Real tokens one generated id stands for (1: ids are tokens); a prompt's ids are tokens.
    token_unit: int = 1
    # A weight push moves the bf16 weights (6.2 GB) at slime's published rate: Qwen3-30B-A3B
    # (61 GB) updated in 7 s, 8.7 GB/s (hebiao064.github.io/rl-weight-sync).
    push_bytes: float = 2 * PARAMS
    push_bytes_per_s: float = 61e9 / 7.0

    def decode_step_s(self, batch: int, kv_tokens: float) -> float:
        return (
            self.step_fixed_s + self.step_per_seq_s * batch + self.step_per_kv_token_s * kv_tokens
        )

    def decode_tokens_per_s(self, batch: int, mean_context: float) -> float:
        """Tokens/s of one engine running `batch` requests of `mean_context` tokens."""
        batch = max(1, min(batch, self.max_running, int(self.kv_tokens // max(mean_context, 1))))
        return batch / self.decode_step_s(batch, batch * mean_context)

    def push_s(self) -> float:
        return self.push_bytes / self.push_bytes_per_s

    @classmethod
    def serving(
        cls, model: ModelSpec, mem_fraction_static: float = 0.88, hbm_bytes: float = 80e9,
        **overrides: float | int | None,
    ) -> EngineCost:  # fmt: skip
        """The defaults' derivation for another model and memory setting: the weights' read
        and the per-sequence matmul scale with the parameters, the KV read and the pool with
        the model's KV bytes per token (launch and sampling overhead kept)."""
        base = cls()
        weights = 2 * model.params
        kv = model.kv_bytes_per_token
        fields: dict[str, float | int | None] = {
            "step_fixed_s": base.step_fixed_s
            - 2 * PARAMS / (0.7 * H100_HBM_BYTES_PER_S)
            + weights / (0.7 * H100_HBM_BYTES_PER_S),
            "step_per_seq_s": base.step_per_seq_s * model.params / PARAMS,
            "step_per_kv_token_s": kv / (0.7 * H100_HBM_BYTES_PER_S),
            "prefill_tokens_per_s": 0.4 * H100_BF16_FLOPS / (2 * model.params),
            "kv_tokens": int((hbm_bytes * mem_fraction_static - weights) / kv),
            "push_bytes": weights,
        }
        return cls(**{**fields, **overrides})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Workload:
    """What the simulated policy generates per turn: a search with probability `p_search`,
    else an answer; a turn's length is log-normal (median, sigma), cut at the request's
    max_new_tokens (a cut turn ends on "length"). The number of searches per sample is then
    geometric, cut at the recipe's turn budget: a long tail of both turns and tokens."""

    # Searches per sample: Search-R1 GRPO runs plateau at ~1-2 searches (J. Su, "Search-R1,
    # Re-examined", 2026); our demo's trained policy: 1.29 per question. p = 0.6 gives 1.3
    # (original's 4 rounds) and 2.3 turns per sample, as bench/orchestrator_scale measured.
    p_search: float = 0.6
    # Tokens per turn: median 120, sigma 0.7 (mean 154, p99 610 -> cut at 512/500): the
    # 30-200-token turns of bench/trainer.py's Search-R1 spread, with a tail to the per-turn
    # budget that slime and the original cap at 512 and 500.
    turn_median_tokens: float = 120.0
    turn_sigma: float = 0.7

    def draw(self, rng: random.Random, max_new_tokens: int) -> tuple[int, bool, bool]:
        """(tokens, searches, cut at max_new_tokens) of one turn."""
        n = round(rng.lognormvariate(math.log(self.turn_median_tokens), self.turn_sigma))
        n = max(n, 1)
        return min(n, max_new_tokens), rng.random() < self.p_search, n >= max_new_tokens


# Our retriever's measured latency by concurrency (docs/benchmarks.md, "Retriever", quiet
# machine, encoder in a child process: c -> p50 ms): MiniLM over 50,000 passages on 2 CPU cores.
# Past the last point the server is saturated (216 QPS): p50 grows as c / 216 s.
RETRIEVER_P50_MS = ((1, 21.6), (8, 47.8), (32, 141.4), (64, 284.3))
RETRIEVER_SATURATED_QPS = 216.2
RETRIEVER_SIGMA = 0.25  # log-normal spread: p99/p50 = 1.67 at c=32 (236.9 / 141.4 ms)


def retriever_p50_s(concurrency: float) -> float:
    pts = RETRIEVER_P50_MS
    c = max(concurrency, 1.0)
    if c >= pts[-1][0]:
        return max(pts[-1][1] / 1000, c / RETRIEVER_SATURATED_QPS)
    for (c0, m0), (c1, m1) in itertools.pairwise(pts):
        if c <= c1:
            return (m0 + (m1 - m0) * (c - c0) / (c1 - c0)) / 1000
    raise AssertionError("unreachable")


class Clock:
    """Simulated time: `time_scale` simulated seconds pass per real second."""

    def __init__(self, time_scale: float) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.scale = time_scale
        self._t0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._t0) * self.scale

    def real_s(self, sim_s: float) -> float:
        return sim_s / self.scale
