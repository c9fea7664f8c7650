"""Example user hooks loaded by dotted path in the contract tests."""

from __future__ import annotations

from typing import Any


def length_reward(sample: Any) -> float:
    return len(sample.response_text) / 100


def rank_in_group(samples: list[Any]) -> list[float]:
    """A group reward: 1 for the best EM in the group, 0 otherwise (needs the whole group)."""
    best = max(s.reward_components["em"] for s in samples)
    return [1.0 if s.reward_components["em"] == best else 0.0 for s in samples]


async def async_reward(sample: Any) -> float:
    return 0.5


def two_args(sample: Any, extra: Any) -> float:
    return 0.0


def bad_group(samples: list[Any]) -> list[float]:
    return [1.0]


async def answer_directly(rollout: Any, sample: Any) -> None:
    """A custom generate function: one generation call, no tools."""
    result, _latency = await rollout.generate(sample, 16)
    text = rollout.tokenizer.decode(result.output_ids)
    sample.append_model(list(result.output_ids), result.logprobs, text)
    sample.weight_versions.append(result.weight_version)


def sync_generate(rollout: Any, sample: Any) -> None:
    return None


NOT_CALLABLE = 3


def keep_odd_prompts(group: list[Any]) -> bool:
    """A group filter: keeps the groups of odd-numbered prompts (`q1`, `q3`, ...)."""
    return int(group[0].prompt.metadata["index"]) % 2 == 1


def keep_all(group: list[Any]) -> bool:
    """A filter that rejects nothing: dynamic sampling's bookkeeping with every group kept."""
    return True


def reject_all(group: list[Any]) -> bool:
    """A filter that keeps nothing: the data runs out before the trainer's batch."""
    return False
