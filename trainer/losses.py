"""The GRPO loss as small pure functions over flat per-token tensors (spec section 5).

Every tensor here is 1-D over the response tokens of a (micro-)batch: token t belongs to sample
`sample_index[t]`. Aggregation is expressed as per-token *weights* computed once per mini-batch
(`aggregation_weights`), so that summing `weight * value` over micro-batches (and over ranks)
gives exactly the mini-batch's token-mean or sample-mean: gradient accumulation and data
parallelism do not change the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.config import Aggregation, KLEstimator, LossConfig


def finite_mask(*tensors: torch.Tensor) -> torch.Tensor:
    """True where every tensor is finite (engines occasionally emit NaN/inf logprobs)."""
    ok = torch.ones_like(tensors[0], dtype=torch.bool)
    for t in tensors:
        ok &= torch.isfinite(t)
    return ok


def zero_where_invalid(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # `where`, not a multiply: NaN * 0 is NaN, and its gradient would be too.
    return torch.where(valid, x, torch.zeros_like(x))


def clamp_log_ratio(log_ratio: torch.Tensor, bound: float) -> torch.Tensor:
    return log_ratio.clamp(min=-bound, max=bound)


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor  # per token
    ratio: torch.Tensor
    clipped_low: torch.Tensor  # bool: the lower clip is active (A < 0, ratio < 1 - eps_low)
    clipped_high: torch.Tensor  # bool: the upper clip is active (A > 0, ratio > 1 + eps_high)
    clipped_dual: torch.Tensor  # bool: the dual clip is active (A < 0, loss capped at -A * c)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    log_ratio_clamp: float = 20.0,
    clip_ratio_c: float | None = None,
) -> PolicyLoss:
    """`max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))` per token.

    With `clip_ratio_c` (verl's dual-clip, Ye et al. 2019), tokens with A < 0 take
    `min(that, -A * c)`: a very large ratio on a bad action no longer makes an unbounded loss.
    """
    ratio = torch.exp(clamp_log_ratio(logp - old_logp, log_ratio_clamp))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    dual = torch.zeros_like(active)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    return PolicyLoss(
        loss=loss,
        ratio=ratio,
        clipped_low=active & (ratio < 1.0 - eps_low),
        clipped_high=active & (ratio > 1.0 + eps_high),
        clipped_dual=dual,
    )


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    k1: `logp - ref`; k2: `(logp - ref)^2 / 2`; low_var_kl (k3): `exp(r) - 1 - r` with
    `r = ref - logp` (clamped to [-20, 20] before exp), the result clamped to [-10, 10].
    """
    if estimator == KLEstimator.K1:
        return logp - ref_logp
    if estimator == KLEstimator.K2:
        return 0.5 * (logp - ref_logp) ** 2
    r = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(r) - 1.0 - r).clamp(-10.0, 10.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax of each row: `logsumexp(z) - sum(softmax(z) * z)`."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def aggregation_weights(
    mask: torch.Tensor, sample_index: torch.Tensor, num_samples: int, mode: Aggregation
) -> torch.Tensor:
    """Per-token weights w with `sum(w * x)` = the chosen mean of x over unmasked tokens.

    token_mean: `1 / (unmasked tokens in the batch)`; sample_mean: `1 / (n_s * S)` with n_s the
    unmasked tokens of the token's sample and S the samples having any. Masked tokens get 0.
    """
    m = mask.to(torch.float64)
    if mode == Aggregation.TOKEN_MEAN:
        total = m.sum()
        w = m / total if total > 0 else torch.zeros_like(m)
        return w.to(torch.float32)
    counts = torch.zeros(num_samples, dtype=torch.float64).index_add_(0, sample_index, m)
    live = int((counts > 0).sum())
    if live == 0:
        return torch.zeros_like(m, dtype=torch.float32)
    per_token = m / (counts[sample_index].clamp(min=1.0) * live)
    return per_token.to(torch.float32)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    sample_index: torch.Tensor,
    num_samples: int,
    mode: Aggregation,
) -> torch.Tensor:
    w = aggregation_weights(mask, sample_index, num_samples, mode)
    return (zero_where_invalid(values, mask.bool()) * w).sum()


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar, differentiable; already weighted for aggregation
    metrics: dict[str, float]  # weighted sums: add them up over micro-batches


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    cfg: LossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    tis_weights: torch.Tensor | None = None,
) -> LossTerms:
    """Policy loss (times TIS weights) + kl_coef * KL - entropy_coef * entropy, aggregated.

    `weights` come from `aggregation_weights` (0 on observation and masked tokens). Tokens
    whose trainer logprob is non-finite are dropped here too, and counted; so are tokens whose
    reference logprob is non-finite when the KL is in the loss (`kl_coef > 0`).
    """
    valid = (weights > 0) & finite_mask(logp, old_logp)
    nonfinite = int(((weights > 0) & ~valid).sum())
    ref_ok = torch.isfinite(ref_logp) if ref_logp is not None else torch.ones_like(valid)
    nonfinite_ref = int((valid & ~ref_ok).sum())
    if ref_logp is not None and cfg.kl_coef > 0:
        # A NaN/inf reference would make the loss (and, for k2, every gradient) non-finite.
        valid = valid & ref_ok
    w = zero_where_invalid(weights, valid)
    lp = zero_where_invalid(logp, valid)
    old = zero_where_invalid(old_logp, valid)
    pg = ppo_clip_loss(
        lp,
        old,
        advantages,
        eps_low=cfg.eps_clip_low,
        eps_high=cfg.eps_clip_high,
        log_ratio_clamp=cfg.log_ratio_clamp,
        clip_ratio_c=cfg.clip_ratio_c,
    )
    pg_tok = pg.loss if tis_weights is None else pg.loss * tis_weights
    pg_loss = (pg_tok * w).sum()
    total = pg_loss
    metrics: dict[str, float] = {
        "pg_loss": float(pg_loss.detach()),
        "clip_fraction_low": float((pg.clipped_low.float() * w).sum()),
        "clip_fraction_high": float((pg.clipped_high.float() * w).sum()),
        "ratio_mean": float((pg.ratio.detach() * w).sum()),
        "nonfinite_trainer_logprobs": float(nonfinite),
    }
    if cfg.clip_ratio_c is not None:
        metrics["clip_fraction_dual"] = float((pg.clipped_dual.float() * w).sum())
    if ref_logp is not None:
        metrics["nonfinite_ref_logprobs"] = float(nonfinite_ref)
        # Without kl_coef the token still trains; it is only left out of the `kl` metric.
        kl_ok = valid & ref_ok
        kl_tok = kl_penalty(lp, zero_where_invalid(ref_logp, kl_ok), cfg.kl_estimator)
        kl = (kl_tok * zero_where_invalid(w, kl_ok)).sum()
        metrics["kl"] = float(kl.detach())
        if cfg.kl_coef > 0:
            total = total + cfg.kl_coef * kl
    if entropy is not None:
        ent = (zero_where_invalid(entropy, valid) * w).sum()
        metrics["entropy"] = float(ent.detach())
        if cfg.entropy_coef > 0:
            total = total - cfg.entropy_coef * ent
    metrics["loss"] = float(total.detach())
    return LossTerms(loss=total, metrics=metrics)
