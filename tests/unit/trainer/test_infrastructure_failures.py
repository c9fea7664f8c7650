"""Samples whose search failed because the retriever was down stay out of the loss by default."""

from __future__ import annotations

import pytest

from tests.factories import make_trajectory
from trainer.config import LossConfig, TrainerConfig
from trainer.step import build_sequences


def group(rewards: list[float], *, failed: set[int]) -> list:  # type: ignore[type-arg]
    out = []
    for k, r in enumerate(rewards):
        t = make_trajectory(f"t-{k}", group_id="g", seed=k)
        t.group_size = len(rewards)
        t.reward.total = r
        t.infrastructure_failure = k in failed
        out.append(t)
    return out


def test_infrastructure_failures_are_left_out_and_counted() -> None:
    # Sample 3 failed (reward 0 only because the retriever was down): without it the group's
    # advantages come from the three healthy samples alone.
    samples, advantages, m = build_sequences(
        group([1.0, 0.0, 1.0, 0.0], failed={3}), TrainerConfig()
    )
    assert sorted(s.sample_id for s in samples) == ["t-0", "t-1", "t-2"]
    assert m["samples/infrastructure_failures"] == 1.0
    adv = {s.sample_id: a for s, a in zip(samples, advantages.tolist(), strict=True)}
    mean, std = 2 / 3, (1 / 3) ** 0.5  # unbiased std of [1, 0, 1]
    assert adv["t-0"] == pytest.approx((1 - mean) / (std + 1e-6))
    assert adv["t-1"] == pytest.approx((0 - mean) / (std + 1e-6))


def test_they_can_be_trained_on_purpose() -> None:
    cfg = TrainerConfig(loss=LossConfig(train_on_infrastructure_failures=True))
    samples, _, m = build_sequences(group([1.0, 0.0, 1.0, 0.0], failed={3}), cfg)
    assert len(samples) == 4 and m["samples/infrastructure_failures"] == 1.0


def test_a_batch_of_only_failures_is_skipped_not_a_crash() -> None:
    """A step rolled out while the retriever was down can be all failures: the trainer used to
    crash on the empty batch (`torch.where` on a float mask), restart, and crash again on the
    same entries (found by bench/chaos.py, kill:retriever)."""
    samples, advantages, m = build_sequences(
        group([0.0, 0.0, 0.0, 0.0], failed={0, 1, 2, 3}), TrainerConfig()
    )
    assert samples == [] and advantages.numel() == 0
    assert m["samples/infrastructure_failures"] == 4.0
