"""One training step from a list of trajectories, independent of the bus and of HTTP.

trajectories -> samples -> group advantages -> old / reference logprobs -> TIS weights ->
`backend.train_step`. Returns the step's metrics (spec section 5 and the issue's list).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence

import torch

from protos.trajectory import Trajectory
from trainer.advantages import group_advantages
from trainer.backend import LogprobKind, TrainerBackend
from trainer.batching import Sample, sample_from_trajectory
from trainer.config import OldLogprobSource, TISMode, TrainerConfig
from trainer.tis import tis_weights

log = logging.getLogger(__name__)


def build_samples(
    trajectories: Sequence[Trajectory], cfg: TrainerConfig
) -> tuple[list[Sample], dict[str, float]]:
    """Samples ordered by group (so mini-batches keep groups together), with advantages."""
    infra = sum(t.infrastructure_failure for t in trajectories)
    if not cfg.loss.train_on_infrastructure_failures:
        trajectories = [t for t in trajectories if not t.infrastructure_failure]
    order = sorted(range(len(trajectories)), key=lambda i: (trajectories[i].group_id, i))
    samples: list[Sample] = []
    nonfinite = 0
    for i in order:
        s, bad = sample_from_trajectory(trajectories[i])
        samples.append(s)
        nonfinite += bad
    adv = group_advantages(
        [s.reward for s in samples], [s.group_id for s in samples], cfg.advantages
    )
    for s, a in zip(samples, adv.advantages.tolist(), strict=True):
        s.advantage = a
    # Reward statistics over everything consumed, before any filtering.
    rewards = [s.reward for s in samples] or [0.0]
    ems = [s.extras["em"] for s in samples if "em" in s.extras]
    if cfg.advantages.filter_degenerate_groups:
        samples = [s for s, d in zip(samples, adv.degenerate.tolist(), strict=True) if not d]
    advs = adv.advantages
    resp = [s.response_len for s in samples] or [0]
    masked = sum(float(s.loss_mask.sum()) for s in samples)
    total_resp = sum(resp)
    metrics = {
        "samples": float(len(samples)),
        "groups": float(adv.num_groups),
        "groups/degenerate": float(adv.num_degenerate_groups),
        "groups/degenerate_fraction": adv.num_degenerate_groups / max(adv.num_groups, 1),
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "advantages/mean": float(advs.mean()) if advs.numel() else 0.0,
        "advantages/abs_mean": float(advs.abs().mean()) if advs.numel() else 0.0,
        "response_length/mean": statistics.fmean(resp),
        "response_length/max": float(max(resp)),
        # Response tokens that are retrieved text (loss mask 0): if it dominates, little trains.
        "loss_mask/observation_fraction": 1.0 - masked / total_resp if total_resp else 0.0,
        "nonfinite_rollout_logprobs": float(nonfinite),
        "samples/infrastructure_failures": float(infra),
    }
    if ems:
        metrics["reward/em"] = statistics.fmean(ems)
    return samples, metrics


def _flat(samples: Sequence[Sample], name: str) -> torch.Tensor:
    return torch.cat([getattr(s, name) for s in samples])


def prepare_logprobs(
    samples: list[Sample], backend: TrainerBackend, cfg: TrainerConfig
) -> dict[str, float]:
    """Old-policy and reference logprobs, TIS weights; returns their metrics."""
    metrics: dict[str, float] = {}
    have_rollout = all(s.rollout_logprobs is not None for s in samples)
    if cfg.loss.old_logprobs == OldLogprobSource.ROLLOUT and have_rollout:
        for s in samples:
            s.old_logprobs = s.rollout_logprobs
    else:
        if cfg.loss.old_logprobs == OldLogprobSource.ROLLOUT:
            metrics["old_logprobs_recomputed"] = 1.0  # some trajectory had no rollout logprobs
        backend.compute_logprobs(samples, LogprobKind.OLD)
    if cfg.loss.kl_coef > 0:
        backend.compute_logprobs(samples, LogprobKind.REF)
    if not samples:
        return metrics
    mask = _flat(samples, "loss_mask") > 0
    index = torch.cat(
        [torch.full((s.response_len,), k, dtype=torch.long) for k, s in enumerate(samples)]
    )
    if have_rollout and cfg.loss.old_logprobs == OldLogprobSource.RECOMPUTE:
        old, rollout = _flat(samples, "old_logprobs"), _flat(samples, "rollout_logprobs")
        ok = mask & torch.isfinite(old)
        diff = (old - rollout).abs()[ok]
        metrics["logprob_diff/trainer_vs_rollout_abs_mean"] = (
            float(diff.mean()) if diff.numel() else 0.0
        )
        metrics["logprob_diff/trainer_vs_rollout_abs_max"] = (
            float(diff.max()) if diff.numel() else 0.0
        )
    if cfg.tis.mode != TISMode.OFF and have_rollout:
        res = tis_weights(
            _flat(samples, "old_logprobs"),
            _flat(samples, "rollout_logprobs"),
            mask,
            index,
            len(samples),
            cfg.tis,
        )
        for s, w in zip(
            samples, torch.split(res.weights, [s.response_len for s in samples]), strict=True
        ):
            s.tis_weights = w
        metrics.update(res.metrics)
    return metrics


def valid_for(trajectories: Sequence[Trajectory], vocab_size: int | None) -> list[Trajectory]:
    """Drop trajectories with token ids the model cannot embed (a mismatched tokenizer):
    one bad sample must not crash every restart of the trainer on the same batch."""
    if vocab_size is None:
        return list(trajectories)
    ok = []
    for t in trajectories:
        ids = [*t.prompt_token_ids, *t.response_token_ids]
        if ids and (max(ids) >= vocab_size or min(ids) < 0):
            log.warning(
                "dropped a trajectory with out-of-vocabulary token ids",
                extra={"trajectory_id": t.trajectory_id, "vocab_size": vocab_size},
            )
            continue
        ok.append(t)
    return ok


def train_on(
    trajectories: Sequence[Trajectory], backend: TrainerBackend, cfg: TrainerConfig
) -> dict[str, float]:
    valid = valid_for(trajectories, backend.vocab_size)
    samples, metrics = build_samples(valid, cfg)
    metrics["invalid_samples"] = float(len(trajectories) - len(valid))
    if not samples:
        metrics["skipped"] = 1.0
        return metrics
    t0 = time.perf_counter()
    metrics.update(prepare_logprobs(samples, backend, cfg))
    metrics["time/logprobs_s"] = time.perf_counter() - t0  # old/ref forward passes, TIS
    metrics.update(backend.train_step(samples))
    return metrics
