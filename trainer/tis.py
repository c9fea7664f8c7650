"""Truncated importance sampling for the rollout/trainer mismatch (spec section 5).

The engine samples with its own numerics (kernels, precision), so its logprobs differ from the
trainer's for the same weights. The policy loss is re-weighted per token by
`exp(logp_old_trainer - logp_rollout)`, bounded:

- `token` mode: `w = min(exp(old - rollout), C)`;
- `mis` mode (slime's richer variant): token, sequence (product) or geometric-mean level;
  truncate / clip / mask outside `[lower, upper]`; a whole sequence is vetoed when any of its
  token ratios falls below `veto_threshold`; optional renormalisation to mean 1 over the
  surviving tokens, never above the bound (`cap`, or `upper` in `mis` mode).

Weights are computed once per rollout batch, without gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.config import TISAction, TISConfig, TISLevel, TISMode
from trainer.losses import clamp_log_ratio, finite_mask, zero_where_invalid


@dataclass(frozen=True)
class TISResult:
    weights: torch.Tensor  # per token; 0 where the token does not count
    valid: torch.Tensor  # bool per token: counted (loss mask and finite logprobs)
    metrics: dict[str, float]
    clipped: int  # valid tokens whose weight the bounds changed (`tis/clip_fraction` x valid)


def kish_ess(weights: torch.Tensor) -> float:
    """Normalised Kish effective sample size `(sum w)^2 / (N * sum w^2)`, in (0, 1]."""
    n = weights.numel()
    sq = float((weights.double() ** 2).sum())
    if n == 0 or sq == 0.0:
        return 0.0
    return float(weights.double().sum()) ** 2 / (n * sq)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _per_sample_sum(x: torch.Tensor, sample_index: torch.Tensor, num_samples: int) -> torch.Tensor:
    return torch.zeros(num_samples, dtype=x.dtype).index_add_(0, sample_index, x)


def tis_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    sample_index: torch.Tensor,
    num_samples: int,
    cfg: TISConfig,
) -> TISResult:
    old_logp, rollout_logp = old_logp.double(), rollout_logp.double()
    valid = mask.bool() & finite_mask(old_logp, rollout_logp)
    # Raw log-ratios for the aggregates and the veto; like slime and verl, only what goes into
    # exp is clamped (a token's ratio, or a sequence's sum / mean), never the terms of a sum.
    raw_log_r = zero_where_invalid(old_logp - rollout_logp, valid)
    log_r = clamp_log_ratio(raw_log_r, cfg.log_ratio_clamp)
    n_valid = int(valid.sum())
    vetoed_samples = 0
    rejected = torch.zeros_like(valid)  # weight 0 on purpose: masked or vetoed
    bound = cfg.cap
    if cfg.mode == TISMode.OFF:
        w = valid.double()
        modified = torch.zeros_like(valid)
    elif cfg.mode == TISMode.TOKEN:
        raw = torch.exp(log_r)
        modified = valid & (raw > cfg.cap)
        w = raw.clamp(max=cfg.cap)
    else:
        if cfg.level == TISLevel.TOKEN:
            log_w = log_r
        else:
            seq = _per_sample_sum(raw_log_r, sample_index, num_samples)
            if cfg.level == TISLevel.GEOMETRIC:
                counts = _per_sample_sum(valid.double(), sample_index, num_samples)
                seq = seq / counts.clamp(min=1.0)
            log_w = clamp_log_ratio(seq, cfg.log_ratio_clamp)[sample_index]
        raw = torch.exp(log_w)
        outside_hi = raw > cfg.upper
        outside_lo = raw < cfg.lower
        if cfg.action == TISAction.TRUNCATE:
            w, modified = raw.clamp(max=cfg.upper), outside_hi
        elif cfg.action == TISAction.CLIP:
            w, modified = raw.clamp(cfg.lower, cfg.upper), outside_hi | outside_lo
        else:
            modified = rejected = outside_hi | outside_lo
            w = torch.where(modified, torch.zeros_like(raw), raw)
        modified = modified & valid
        bound = cfg.upper
        if cfg.veto_threshold is not None:
            # In log space: a ratio below exp(-clamp) must still count as below the threshold.
            low = (valid & (raw_log_r < _log(cfg.veto_threshold))).double()
            veto = _per_sample_sum(low, sample_index, num_samples) > 0
            vetoed_samples = int(veto.sum())
            rejected = rejected | veto[sample_index]
            w = torch.where(veto[sample_index], torch.zeros_like(w), w)
    w = zero_where_invalid(w, valid)
    kept = valid & ~rejected
    if cfg.renormalize and cfg.mode != TISMode.OFF and bool(kept.any()):
        # The mean is over the tokens that train: counting the rejected zeros would inflate
        # every survivor (slime averages the pre-rejection weights, so rejected tokens still
        # move its mean). The bound is the variance cap of the method, so it still holds
        # afterwards; where it binds the mean ends a little below 1 (one clamp, no re-fitting).
        mean = w[kept].mean()
        if mean > 0:
            w = (w / mean).clamp(max=bound)
    live = _per_sample_sum(valid.double(), sample_index, num_samples) > 0
    wv = w[valid]
    metrics = {
        "tis/weight_mean": float(wv.mean()) if n_valid else 0.0,
        "tis/weight_max": float(wv.max()) if n_valid else 0.0,
        "tis/clip_fraction": float(modified.sum()) / n_valid if n_valid else 0.0,
        "tis/veto_fraction": vetoed_samples / max(int(live.sum()), 1),
        "tis/effective_sample_size": kish_ess(wv),
    }
    return TISResult(weights=w.float(), valid=valid, metrics=metrics, clipped=int(modified.sum()))


@dataclass
class MismatchSums:
    """`loss.old_logprobs: forward`: the trainer-vs-rollout metrics (and token TIS's) built up
    micro-batch by micro-batch, as the training forward produces the old logprobs; `metrics`
    combines every data-parallel rank's into what `tis_weights` and the staged path report."""

    w_sum: float = 0.0
    w_sq: float = 0.0
    w_max: float = 0.0
    valid: int = 0
    clipped: int = 0
    diff_sum: float = 0.0
    diff_max: float = 0.0
    diff_n: int = 0

    def add_diff(
        self, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
    ) -> None:
        """|trainer - rollout| over the masked tokens whose trainer logprob is finite."""
        ok = mask.bool() & torch.isfinite(old_logp)
        diff = (old_logp - rollout_logp).abs()[ok]
        if diff.numel():
            self.diff_sum += float(diff.double().sum())
            self.diff_max = _max(self.diff_max, float(diff.max()))
            self.diff_n += diff.numel()

    def diff_metrics(self) -> dict[str, float]:
        return {
            "logprob_diff/trainer_vs_rollout_abs_mean": self.diff_sum / self.diff_n
            if self.diff_n
            else 0.0,
            "logprob_diff/trainer_vs_rollout_abs_max": self.diff_max,
        }

    def add(
        self, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cfg: TISConfig
    ) -> torch.Tensor | None:
        """This micro-batch's TIS weights (None with TIS off), its sums added here."""
        self.add_diff(old_logp, rollout_logp, mask)
        if cfg.mode == TISMode.OFF:
            return None
        assert cfg.mode == TISMode.TOKEN and not cfg.renormalize  # TrainerConfig checks
        n = old_logp.numel()
        res = tis_weights(old_logp, rollout_logp, mask, torch.zeros(n, dtype=torch.long), 1, cfg)
        wv = res.weights.double()[res.valid]
        if wv.numel():
            self.w_sum += float(wv.sum())
            self.w_sq += float((wv**2).sum())
            self.w_max = max(self.w_max, float(wv.max()))
            self.valid += wv.numel()
            self.clipped += res.clipped
        return res.weights

    @staticmethod
    def metrics(ranks: list[MismatchSums], cfg: TISConfig) -> dict[str, float]:
        total = MismatchSums(w_max=max(r.w_max for r in ranks))
        for r in ranks:
            total.diff_max = _max(total.diff_max, r.diff_max)
            total.w_sum += r.w_sum
            total.w_sq += r.w_sq
            total.valid += r.valid
            total.clipped += r.clipped
            total.diff_sum += r.diff_sum
            total.diff_n += r.diff_n
        out = total.diff_metrics()
        if cfg.mode == TISMode.OFF:
            return out
        n = total.valid
        ess = total.w_sum**2 / (n * total.w_sq) if n and total.w_sq else 0.0
        return out | {
            "tis/weight_mean": total.w_sum / n if n else 0.0,
            "tis/weight_max": total.w_max,
            "tis/clip_fraction": total.clipped / n if n else 0.0,
            "tis/veto_fraction": 0.0,
            "tis/effective_sample_size": ess,
        }


def _max(a: float, b: float) -> float:
    """The larger, keeping a NaN as torch's `max` does (a NaN rollout logprob shows)."""
    return b if math.isnan(b) or b > a else a
