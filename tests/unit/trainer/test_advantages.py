"""GRPO advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.advantages import group_advantages
from trainer.config import AdvantageConfig


def test_group_normalized_with_unbiased_std() -> None:
    # Group a: rewards 1,0,0,1: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3.
    out = group_advantages([1, 0, 0, 1, 1, 1, 0.3], list("aaaabbc"), AdvantageConfig())
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = [a, -a, -a, a, 0.0, 0.0, 0.0]
    assert out.advantages.tolist() == pytest.approx(expected, abs=1e-6)
    assert out.num_groups == 3
    # b (all equal) and c (a single sample) carry no signal.
    assert out.num_degenerate_groups == 2
    assert out.degenerate.tolist() == [False] * 4 + [True] * 3


def test_dr_grpo_drops_std() -> None:
    out = group_advantages([1.0, 0.0, 0.5], ["g"] * 3, AdvantageConfig(normalize_std=False))
    assert out.advantages.tolist() == pytest.approx([0.5, -0.5, 0.0])


def test_groups_need_not_be_contiguous() -> None:
    out = group_advantages(torch.tensor([2.0, 10.0, 0.0, 20.0]), list("abab"), AdvantageConfig())
    # Each group has 2 samples, deviation +-1 and +-5, unbiased std sqrt(2) and 5*sqrt(2).
    s = 1 / (math.sqrt(2) + 1e-6)
    t = 5 / (5 * math.sqrt(2) + 1e-6)
    assert out.advantages.tolist() == pytest.approx([s, -t, -s, t], abs=1e-6)


def test_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 rewards for 3 group ids"):
        group_advantages([1.0, 0.0], ["a", "a", "b"], AdvantageConfig())


def test_no_samples_no_groups() -> None:
    adv = group_advantages([], [], AdvantageConfig())
    assert adv.advantages.numel() == 0 and adv.degenerate.dtype == torch.bool
    assert adv.num_groups == 0 and adv.num_degenerate_groups == 0
