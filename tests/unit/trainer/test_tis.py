"""TIS weights and ESS against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import TISAction, TISConfig, TISLevel, TISMode
from trainer.tis import kish_ess, tis_weights


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def test_kish_ess() -> None:
    assert kish_ess(t(1, 1, 1, 1)) == pytest.approx(1.0)
    # (2 + 0.5 + 1)^2 / (3 * (4 + 0.25 + 1)) = 12.25 / 15.75
    assert kish_ess(t(2, 0.5, 1)) == pytest.approx(12.25 / 15.75)
    assert kish_ess(t(1, 0, 0, 0)) == pytest.approx(0.25)


def test_token_tis() -> None:
    old = t(math.log(3), math.log(0.5), 0.0, 5.0)
    rollout = torch.zeros(4)
    mask = t(1, 1, 1, 0)  # the last token is an observation
    res = tis_weights(
        old, rollout, mask, torch.tensor([0, 0, 1, 1]), 2, TISConfig(mode=TISMode.TOKEN)
    )
    assert res.weights.tolist() == pytest.approx([2.0, 0.5, 1.0, 0.0], abs=1e-6)
    assert res.metrics["tis/weight_mean"] == pytest.approx(3.5 / 3)
    assert res.metrics["tis/weight_max"] == pytest.approx(2.0)
    assert res.metrics["tis/clip_fraction"] == pytest.approx(1 / 3)
    assert res.metrics["tis/effective_sample_size"] == pytest.approx(12.25 / 15.75)


def test_nonfinite_rollout_logprob_is_dropped() -> None:
    res = tis_weights(
        t(0.0, 0.0),
        t(float("nan"), 0.0),
        t(1, 1),
        torch.tensor([0, 0]),
        1,
        TISConfig(mode=TISMode.TOKEN),
    )
    assert res.valid.tolist() == [False, True]
    assert res.weights.tolist() == [0.0, 1.0]


def _mis(old: torch.Tensor, index: list[int], n: int, **kw: object) -> torch.Tensor:
    cfg = TISConfig(mode=TISMode.MIS, **kw)  # type: ignore[arg-type]
    res = tis_weights(old, torch.zeros_like(old), torch.ones_like(old), torch.tensor(index), n, cfg)
    return res.weights


def test_mis_sequence_truncate_and_mask() -> None:
    old = t(math.log(2), math.log(0.5), math.log(3))
    # Sample 0: ratios 2 * 0.5 = 1; sample 1: 3, truncated to the upper bound 2.
    w = _mis(old, [0, 0, 1], 2, level=TISLevel.SEQUENCE, action=TISAction.TRUNCATE)
    assert w.tolist() == pytest.approx([1.0, 1.0, 2.0])
    w = _mis(old, [0, 0, 1], 2, level=TISLevel.SEQUENCE, action=TISAction.MASK)
    assert w.tolist() == pytest.approx([1.0, 1.0, 0.0])


def test_mis_geometric_clip() -> None:
    old = t(math.log(4), 0.0, math.log(0.25))
    # Sample 0: geometric mean of 4 and 1 = 2; sample 1: 0.25, clipped up to the lower bound.
    w = _mis(old, [0, 0, 1], 2, level=TISLevel.GEOMETRIC, action=TISAction.CLIP)
    assert w.tolist() == pytest.approx([2.0, 2.0, 0.5])


def test_mis_token_mask_and_veto() -> None:
    old = t(math.log(3), 0.0, math.log(1e-5), 0.0)
    cfg = TISConfig(mode=TISMode.MIS, action=TISAction.MASK)
    res = tis_weights(old, torch.zeros(4), torch.ones(4), torch.tensor([0, 0, 1, 1]), 2, cfg)
    # Token 0 is outside [0.5, 2]: masked; sample 1 holds a ratio below 1e-4: vetoed whole.
    assert res.weights.tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0])
    assert res.metrics["tis/veto_fraction"] == pytest.approx(0.5)


def test_mis_renormalize() -> None:
    old = t(0.0, math.log(0.5))
    w = _mis(old, [0, 1], 2, renormalize=True, veto_threshold=None)
    assert w.tolist() == pytest.approx([4 / 3, 2 / 3])


def test_mis_renormalize_uses_only_surviving_weights() -> None:
    # Token ratios: sample 0 [3, 0.6], sample 1 [1, 1e-5], sample 2 [1, 1.4]. Mask mode drops
    # the 3 (above 2) and the 1e-5; the veto (below 1e-4) zeroes all of sample 1. Survivors
    # 0.6, 1, 1.4 already have mean 1: renormalising must leave them as they are.
    old = t(math.log(3), math.log(0.6), 0.0, math.log(1e-5), 0.0, math.log(1.4))
    w = _mis(old, [0, 0, 1, 1, 2, 2], 3, action=TISAction.MASK, renormalize=True)
    assert w.tolist() == pytest.approx([0.0, 0.6, 0.0, 0.0, 1.0, 1.4], abs=1e-6)


def test_mis_renormalize_never_exceeds_the_upper_bound() -> None:
    # Truncate: ratios 4 -> 2, 0.25, 0.25, 0.5; mean 0.75, so /0.75 gives 8/3 for the first:
    # above upper = 2, it stays at 2 (the others: 1/3, 1/3, 2/3).
    old = t(math.log(4), math.log(0.25), math.log(0.25), math.log(0.5))
    w = _mis(old, [0, 1, 2, 3], 4, renormalize=True, veto_threshold=None)
    assert w.tolist() == pytest.approx([2.0, 1 / 3, 1 / 3, 2 / 3], abs=1e-6)


def test_token_tis_renormalize_never_exceeds_the_cap() -> None:
    # Token TIS, cap 2: ratios 3 -> 2, 0.25, 0.25; mean 2.5 / 3, so 2 * 1.2 = 2.4 -> 2; 0.3, 0.3.
    old = t(math.log(3), math.log(0.25), math.log(0.25))
    cfg = TISConfig(mode=TISMode.TOKEN, renormalize=True)
    res = tis_weights(old, torch.zeros(3), torch.ones(3), torch.tensor([0, 1, 2]), 3, cfg)
    assert res.weights.tolist() == pytest.approx([2.0, 0.3, 0.3], abs=1e-6)


@pytest.mark.parametrize(
    ("level", "log_ratios", "expected_log_w"),
    [
        # slime and verl sum (or average) the raw token log-ratios, then clamp the aggregate to
        # +-20: 25 - 10 = 15, not clamp(25) - 10 = 10.
        (TISLevel.SEQUENCE, (25.0, -10.0), 15.0),
        # (30 + 0) / 2 = 15, not (clamp(30) + 0) / 2 = 10.
        (TISLevel.GEOMETRIC, (30.0, 0.0), 15.0),
        # The aggregate itself is still bounded: 15 + 15 = 30 -> 20.
        (TISLevel.SEQUENCE, (15.0, 15.0), 20.0),
    ],
)
def test_mis_clamps_the_aggregate_not_each_token(
    level: TISLevel, log_ratios: tuple[float, float], expected_log_w: float
) -> None:
    old = torch.tensor(log_ratios, dtype=torch.float64)
    w = _mis(old, [0, 0], 1, level=level, upper=1e12, veto_threshold=None)
    assert w.double().log().tolist() == pytest.approx([expected_log_w] * 2, rel=1e-6)


def test_mis_veto_sees_the_unclamped_token_ratio() -> None:
    # A token ratio of exp(-30) is below a veto threshold of exp(-25); clamping it to exp(-20)
    # first would hide it (verl compares the raw log-ratio with log(threshold)).
    old = torch.tensor([-30.0, 0.0], dtype=torch.float64)
    w = _mis(old, [0, 1], 2, level=TISLevel.TOKEN, action=TISAction.CLIP, veto_threshold=1e-11)
    assert w.tolist() == pytest.approx([0.0, 1.0])
