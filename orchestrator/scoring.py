"""Reward functions: a registry of built-ins plus user functions by dotted path.

A per-sample function has the signature `fn(sample: Sample) -> float`; a group function
(`reward.group: true`) has `fn(samples: list[Sample]) -> list[float]` and receives the whole
GRPO group at once (slime's `--group-rm` crashes the search reward; here it is a first-class
mode with a contract test). Rule components (em, sub_em, f1, format, retrieval, has_answer)
are always computed and recorded, whatever function produces the scalar.

A task whose environment answers every turn scores its samples itself, by its rubric, when
each episode ends (orchestrator/formats/environment.py): then this only checks the rewards are
finite.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from typing import Any

from orchestrator import rewards
from orchestrator.config import RewardConfig
from orchestrator.hooks import HookError, load_hook
from orchestrator.sample import Sample

SampleRewardFn = Callable[[Sample], float]
GroupRewardFn = Callable[[list[Sample]], list[float]]


def _builtins(cfg: RewardConfig) -> dict[str, SampleRewardFn]:

    def shaped_fn(s: Sample) -> float:
        c = s.reward_components
        return rewards.shaped_reward(
            c["em"], c["format"] > 0, c["has_answer"] > 0, c["retrieval"], cfg
        )

    def weighted(s: Sample) -> float:
        return sum(w * s.reward_components[k] for k, w in cfg.weights.items())

    return {
        "em": lambda s: s.reward_components["em"],
        "sub_em": lambda s: s.reward_components["sub_em"],
        "f1": lambda s: s.reward_components["f1"],
        "shaped": shaped_fn,
        "weighted": weighted,
    }


BUILTIN_REWARDS = ("em", "sub_em", "f1", "shaped", "weighted")
COMPONENTS = ("em", "sub_em", "f1", "format", "has_answer", "retrieval")


class Scorer:
    """Scores finished groups in place: `sample.reward` and `sample.reward_components`."""

    def __init__(self, cfg: RewardConfig, *, scored_by_task: bool = False) -> None:
        self.cfg = cfg
        self.scored_by_task = scored_by_task
        if scored_by_task:
            if "function" in cfg.model_fields_set:
                raise HookError(
                    "reward.function: the task's rubric scores its samples (Task.score); "
                    "leave reward.function unset"
                )
            return  # the rubric has scored each sample already: no function to load
        if cfg.function in BUILTIN_REWARDS:
            if cfg.group:
                raise HookError(
                    "reward.group: built-in reward functions score one sample; set group: false"
                )
            self._fn: Callable[..., Any] = _builtins(cfg)[cfg.function]
        else:
            if "." not in cfg.function and ":" not in cfg.function:
                raise HookError(
                    f"reward.function: {cfg.function!r} is neither a built-in "
                    f"({', '.join(BUILTIN_REWARDS)}) nor a dotted path"
                )
            self._fn = load_hook(cfg.function, field="reward.function", n_args=1)
        if cfg.function == "weighted":
            unknown = set(cfg.weights) - set(COMPONENTS)
            if unknown:
                raise HookError(f"reward.weights: unknown components {sorted(unknown)}")

    async def score_group(self, group: list[Sample]) -> None:
        if self.scored_by_task:
            for s in group:
                if not math.isfinite(s.reward):
                    raise ValueError(f"the task's rubric gave {s.trajectory_id} reward {s.reward}")
            return
        start = time.perf_counter()
        for s in group:
            s.reward_components = rewards.components(s.response_text, s.golds)
        if self.cfg.group:
            values = await _maybe_await(self._fn(list(group)))
            if not isinstance(values, list | tuple) or len(values) != len(group):
                raise ValueError(
                    f"reward.function {self.cfg.function} returned {values!r}; "
                    f"a group reward must return one float per sample ({len(group)})"
                )
        else:
            values = [await _maybe_await(self._fn(s)) for s in group]
        elapsed = (time.perf_counter() - start) / max(len(group), 1)
        for s, v in zip(group, values, strict=True):
            v = float(v)
            if not math.isfinite(v):
                raise ValueError(f"reward.function {self.cfg.function} returned {v} (not finite)")
            s.reward = v
            s.reward_s = elapsed


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value  # async reward functions (e.g. a reward model over HTTP) work too
    return value
