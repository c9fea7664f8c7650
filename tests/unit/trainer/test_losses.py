"""Loss terms against hand-computed values (spec section 5)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import Aggregation, KLEstimator, LossConfig
from trainer.losses import (
    aggregate,
    aggregation_weights,
    entropy_from_logits,
    grpo_loss,
    kl_penalty,
    ppo_clip_loss,
)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def test_ppo_clip_asymmetric() -> None:
    # ratios 1.5, 0.5, 0.5, 1.5, 1.1 against advantages 1, -1, 1, -1, 2.
    ratios = t(1.5, 0.5, 0.5, 1.5, 1.1)
    out = ppo_clip_loss(
        ratios.log(), torch.zeros(5), t(1, -1, 1, -1, 2), eps_low=0.2, eps_high=0.28
    )
    # A=1, r=1.5: max(-1.5, -1.28) = -1.28 (upper clip); A=-1, r=0.5: max(0.5, 0.8) = 0.8 (lower
    # clip); A=1, r=0.5: max(-0.5, -0.8); A=-1, r=1.5: max(1.5, 1.28); A=2, r=1.1: -2.2.
    assert out.loss.tolist() == pytest.approx([-1.28, 0.8, -0.5, 1.5, -2.2], abs=1e-6)
    assert out.clipped_high.tolist() == [True, False, False, False, False]
    assert out.clipped_low.tolist() == [False, True, False, False, False]


def test_clip_high_differs_from_symmetric_clip() -> None:
    out = ppo_clip_loss(t(math.log(1.25)), t(0.0), t(1.0), eps_low=0.2, eps_high=0.28)
    assert out.loss.item() == pytest.approx(-1.25)  # inside 1 + 0.28: not clipped
    sym = ppo_clip_loss(t(math.log(1.25)), t(0.0), t(1.0), eps_low=0.2, eps_high=0.2)
    assert sym.loss.item() == pytest.approx(-1.2)


def test_log_ratio_is_clamped() -> None:
    out = ppo_clip_loss(t(0.0), t(-1000.0), t(-1.0), eps_low=0.2, eps_high=0.28)
    assert out.ratio.item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert math.isfinite(out.loss.item())


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        (KLEstimator.K1, math.log(2)),
        (KLEstimator.K2, 0.5 * math.log(2) ** 2),
        # r = log(0.25) - log(0.5) = -log 2: exp(r) - 1 - r = 0.5 - 1 + log 2.
        (KLEstimator.LOW_VAR_KL, 0.5 - 1 + math.log(2)),
    ],
)
def test_kl_estimators(estimator: KLEstimator, expected: float) -> None:
    kl = kl_penalty(t(math.log(0.5)), t(math.log(0.25)), estimator)
    assert kl.item() == pytest.approx(expected, rel=1e-6)


def test_low_var_kl_is_clamped() -> None:
    kl = kl_penalty(t(0.0, -30.0), t(-30.0, 0.0), KLEstimator.LOW_VAR_KL)
    assert kl.tolist() == pytest.approx([10.0, 10.0])  # 19.0 and exp(20) - 21 both clamp


def test_entropy() -> None:
    # Uniform over 4: log 4; one-hot-ish (huge margin): ~0.
    ent = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]))
    assert ent.tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)


def test_aggregation_modes() -> None:
    values = t(1, 2, 3, 4, 5)
    index = torch.tensor([0, 0, 0, 1, 1])
    mask = t(1, 1, 0, 1, 0)
    assert aggregate(values, mask, index, 2, Aggregation.TOKEN_MEAN).item() == pytest.approx(7 / 3)
    # Sample means 1.5 and 4, averaged.
    assert aggregate(values, mask, index, 2, Aggregation.SAMPLE_MEAN).item() == pytest.approx(2.75)
    # A sample with no unmasked token is not counted in the sample mean.
    mask2 = t(1, 1, 0, 0, 0)
    assert aggregate(values, mask2, index, 2, Aggregation.SAMPLE_MEAN).item() == pytest.approx(1.5)


def test_aggregation_weights_split_over_microbatches() -> None:
    # Weights computed once for the whole batch make micro-batch sums add up to the mean.
    index = torch.tensor([0, 0, 1, 2, 2, 2])
    mask = t(1, 1, 1, 1, 0, 1)
    values = t(3, 5, 7, 2, 100, 4)
    w = aggregation_weights(mask, index, 3, Aggregation.SAMPLE_MEAN)
    part = (values[:3] * w[:3]).sum() + (values[3:] * w[3:]).sum()
    assert part.item() == pytest.approx((4 + 7 + 3) / 3)


def _loss(old: torch.Tensor, logp: torch.Tensor, cfg: LossConfig) -> tuple[float, torch.Tensor]:
    logp = logp.clone().requires_grad_(True)
    mask = t(1, 0, 1, 1)
    index = torch.tensor([0, 0, 0, 1])
    w = aggregation_weights(mask, index, 2, cfg.aggregation)
    adv = t(1.0, 1.0, 1.0, -0.5)
    ref = t(-1.0, -9.0, -2.0, -1.5)
    out = grpo_loss(logp, old, adv, w, cfg, ref_logp=ref, entropy=t(1.0, 5.0, 2.0, 3.0))
    out.loss.backward()
    assert logp.grad is not None
    return out.loss.item(), logp.grad


def test_observation_tokens_change_nothing() -> None:
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01, aggregation=Aggregation.SAMPLE_MEAN)
    logp = t(-1.2, -0.3, -2.1, -1.0)
    base_loss, base_grad = _loss(t(-1.0, -1.0, -2.0, -1.1), logp, cfg)
    # Token 1 is an observation: change its old logprob (even to NaN) and its current logprob.
    loss2, grad2 = _loss(t(-1.0, float("nan"), -2.0, -1.1), t(-1.2, -7.0, -2.1, -1.0), cfg)
    assert loss2 == base_loss
    assert torch.equal(grad2, base_grad)
    assert grad2[1].item() == 0.0


def test_grpo_loss_combines_terms() -> None:
    cfg = LossConfig(kl_coef=0.5, entropy_coef=0.1, kl_estimator=KLEstimator.K1)
    logp = t(-1.0, -2.0)
    w = t(0.5, 0.5)
    out = grpo_loss(logp, logp, t(1.0, -1.0), w, cfg, ref_logp=t(-1.5, -1.5), entropy=t(2.0, 4.0))
    # ratio 1: pg = mean(-1, 1) = 0; k1 = mean(0.5, -0.5) = 0; entropy mean 3.
    assert out.metrics["pg_loss"] == pytest.approx(0.0)
    assert out.metrics["kl"] == pytest.approx(0.0)
    assert out.metrics["entropy"] == pytest.approx(3.0)
    assert out.loss.item() == pytest.approx(-0.3)


def test_nonfinite_trainer_logprob_is_dropped_and_counted() -> None:
    cfg = LossConfig(kl_coef=0.0)
    logp = t(-1.0, float("nan")).requires_grad_(True)
    out = grpo_loss(logp, t(-1.0, -1.0), t(1.0, 1.0), t(0.5, 0.5), cfg)
    out.loss.backward()
    assert out.metrics["nonfinite_trainer_logprobs"] == 1
    assert math.isfinite(out.loss.item())
    assert torch.isfinite(logp.grad).all()


# k1 / k2 / k3 of token 0 (logp -1, ref -1.5) at weight 0.5.
_KL0 = {
    KLEstimator.K1: 0.5 * 0.5,
    KLEstimator.K2: 0.5 * 0.5 * 0.5**2,
    KLEstimator.LOW_VAR_KL: 0.5 * (math.exp(-0.5) - 1 + 0.5),
}


@pytest.mark.parametrize("estimator", list(KLEstimator))
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_nonfinite_ref_logprob_is_dropped_and_counted(estimator: KLEstimator, bad: float) -> None:
    cfg = LossConfig(kl_coef=0.1, kl_estimator=estimator)
    logp = t(-1.0, -1.0).requires_grad_(True)
    out = grpo_loss(logp, t(-1.0, -1.0), t(1.0, 1.0), t(0.5, 0.5), cfg, ref_logp=t(-1.5, bad))
    out.loss.backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert out.metrics["nonfinite_ref_logprobs"] == 1
    # Only token 0 counts (weight 0.5): pg = -1 * 0.5, plus its KL term.
    assert out.metrics["pg_loss"] == pytest.approx(-0.5)
    assert out.metrics["kl"] == pytest.approx(_KL0[estimator])
    assert out.loss.item() == pytest.approx(-0.5 + 0.1 * _KL0[estimator])
    assert logp.grad[1].item() == 0.0


def test_nonfinite_ref_logprob_without_kl_keeps_the_policy_term() -> None:
    # kl_coef 0: the reference only feeds the `kl` metric, so the token still trains.
    cfg = LossConfig(kl_coef=0.0)
    out = grpo_loss(
        t(-1.0, -1.0), t(-1.0, -1.0), t(1.0, 1.0), t(0.5, 0.5), cfg, ref_logp=t(-1.5, float("nan"))
    )
    assert out.metrics["pg_loss"] == pytest.approx(-1.0)
    assert math.isfinite(out.metrics["kl"]) and math.isfinite(out.loss.item())
    assert out.metrics["nonfinite_ref_logprobs"] == 1


def test_dual_clip_bounds_the_loss_of_negative_advantages() -> None:
    # verl's dual-clip: for A < 0 the clipped loss is at most -A * c (here c = 3).
    # ratios 5, 2, 5, 0.5 against advantages -1, -1, 1, -2.
    ratios = t(5.0, 2.0, 5.0, 0.5)
    adv = t(-1.0, -1.0, 1.0, -2.0)
    out = ppo_clip_loss(
        ratios.log(), torch.zeros(4), adv, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0
    )
    # A=-1, r=5: max(5, 1.28) = 5 -> min(5, 3) = 3 (dual clip); A=-1, r=2: max(2, 1.28) = 2 < 3;
    # A=1, r=5: max(-5, -1.28) = -1.28 (positive advantage: no dual clip);
    # A=-2, r=0.5: max(1, 1.6) = 1.6 (lower clip) < 6.
    assert out.loss.tolist() == pytest.approx([3.0, 2.0, -1.28, 1.6], abs=1e-6)
    assert out.clipped_dual.tolist() == [True, False, False, False]
    # The dual-clipped token has no gradient through its ratio (a constant -A * c).
    logp = ratios.log().requires_grad_(True)
    loss = ppo_clip_loss(
        logp, torch.zeros(4), adv, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0
    ).loss.sum()
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([0.0, 2.0, 0.0, 0.0], abs=1e-6)


def test_dual_clip_off_by_default_changes_nothing() -> None:
    assert LossConfig().clip_ratio_c is None
    ratios = t(5.0, 2.0, 5.0, 0.5)
    adv = t(-1.0, -1.0, 1.0, -2.0)
    out = ppo_clip_loss(ratios.log(), torch.zeros(4), adv, eps_low=0.2, eps_high=0.28)
    assert out.loss.tolist() == pytest.approx([5.0, 2.0, -1.28, 1.6], abs=1e-6)
    assert not out.clipped_dual.any()


def test_dual_clip_in_grpo_loss_and_its_metric() -> None:
    cfg = LossConfig(kl_coef=0.0, clip_ratio_c=3.0)
    w = t(0.25, 0.25, 0.25, 0.25)
    out = grpo_loss(t(5.0, 2.0, 5.0, 0.5).log(), torch.zeros(4), t(-1, -1, 1, -2), w, cfg)
    assert out.metrics["pg_loss"] == pytest.approx((3.0 + 2.0 - 1.28 + 1.6) / 4)
    assert out.metrics["clip_fraction_dual"] == pytest.approx(0.25)
    plain = grpo_loss(t(5.0).log(), t(0.0), t(-1.0), t(1.0), LossConfig(kl_coef=0.0))
    assert plain.metrics["pg_loss"] == pytest.approx(5.0)
    assert "clip_fraction_dual" not in plain.metrics


@pytest.mark.parametrize("bad", [1.0, 0.5])
def test_dual_clip_constant_must_exceed_one(bad: float) -> None:
    with pytest.raises(ValueError, match="clip_ratio_c"):
        LossConfig(clip_ratio_c=bad)
