"""Search-R1-shaped multi-turn traffic for prefix-cache and routing checks (tests and bench).

Groups of samples share a prompt; each sample runs `turns` generate calls, each on the whole
conversation so far (prompt, earlier outputs, and a random "observation" appended after every
turn, as retrieved passages are). Calls carry a routing key (the group's, the sample's, or
none), and the driver adds up what an engine could have served from its prefix cache and what
it reported as cached (`meta_info.cached_tokens`), by turn: the same accounting as the
orchestrator's `searchr1_rollout_prefix_tokens_total`.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Generate = Callable[..., Awaitable[Any]]  # InferenceClient.generate or EnginePool.generate


@dataclass
class PrefixStats:
    cacheable: dict[str, int] = field(default_factory=lambda: {"first": 0, "later": 0})
    cached: dict[str, int] = field(default_factory=lambda: {"first": 0, "later": 0})
    latency_s: dict[str, list[float]] = field(default_factory=lambda: {"first": [], "later": []})
    calls: int = 0
    wall_s: float = 0.0

    def hit_rate(self, turn: str) -> float:
        return self.cached[turn] / self.cacheable[turn] if self.cacheable[turn] else 0.0

    def median_latency_s(self, turn: str) -> float:
        return statistics.median(self.latency_s[turn]) if self.latency_s[turn] else 0.0

    def pairs(self, prefix: str = "") -> dict[str, float]:
        return {
            f"{prefix}hit_first": round(self.hit_rate("first"), 3),
            f"{prefix}hit_later": round(self.hit_rate("later"), 3),
            f"{prefix}turn_ms_first": round(1000 * self.median_latency_s("first"), 1),
            f"{prefix}turn_ms_later": round(1000 * self.median_latency_s("later"), 1),
            f"{prefix}wall_s": round(self.wall_s, 2),
        }


async def drive(
    generate: Generate,
    *,
    groups: int,
    group_size: int,
    turns: int,
    prompt_tokens: int,
    observation_tokens: int,
    max_new_tokens: int,
    vocab: tuple[int, int],
    key: Literal["group", "sample", "none"] = "group",
    concurrency: int = 16,
    seed: int = 0,
) -> PrefixStats:
    """Run every sample to `turns` calls (temperature 1, so a group's samples diverge after
    their shared prompt); token ids are drawn from `vocab` = [low, high)."""
    rng = random.Random(seed)
    stats = PrefixStats()
    gate = asyncio.Semaphore(concurrency)

    def ids(n: int) -> list[int]:
        return [rng.randrange(*vocab) for _ in range(n)]

    async def sample(group: int, index: int, prompt: list[int]) -> None:
        routing_key = {"group": f"g{group}", "sample": f"g{group}/{index}", "none": None}[key]
        context = list(prompt)
        reusable = len(prompt)  # what an earlier call (this sample's or its group's) has seen
        async with gate:
            for turn in range(turns):
                kind = "first" if turn == 0 else "later"
                start = time.perf_counter()
                result = await generate(
                    context,
                    max_new_tokens=max_new_tokens,
                    temperature=1.0,
                    stop=[],
                    return_logprob=False,
                    routing_key=routing_key,
                )
                stats.latency_s[kind].append(time.perf_counter() - start)
                stats.calls += 1
                stats.cacheable[kind] += reusable
                stats.cached[kind] += min(int(result.cached_tokens), reusable)
                context += list(result.output_ids)
                reusable = len(context)
                context += ids(observation_tokens)

    begin = time.perf_counter()
    prompts = [ids(prompt_tokens) for _ in range(groups)]
    await asyncio.gather(
        *(sample(g, i, prompts[g]) for g in range(groups) for i in range(group_size))
    )
    stats.wall_s = time.perf_counter() - begin
    return stats
