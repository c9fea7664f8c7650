"""The GRPO core: one training step from a list of trajectories, whatever the backend.

trajectories -> `TrainSequence`s -> group advantages -> old / reference logprobs -> TIS
weights: a `TrainBatch`, built once and never mutated -> mini-batches (loss weights) ->
packed micro-batches -> `backend.forward_backward(loss_fn)` -> `backend.optimizer_step()`.
The backend (`trainer.backend`) only runs the model; every decision of the algorithm is here.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protos.trajectory import Trajectory
from trainer.advantages import group_advantages
from trainer.backend import LossFn, Policy, TrainerBackend
from trainer.batching import (
    MicroBatch,
    TrainSequence,
    build_microbatch,
    dummy_microbatch,
    plan_microbatches,
    sequence_from_trajectory,
    shard_plan,
    split_minibatches,
)
from trainer.config import OldLogprobSource, TISMode, TrainerConfig
from trainer.losses import LossTerms, aggregation_weights, grpo_loss
from trainer.tis import MismatchSums, tis_weights

log = logging.getLogger(__name__)

# Token counts: summed over mini-batches (the other metrics are averaged).
_COUNTS = ("nonfinite_trainer_logprobs", "nonfinite_ref_logprobs")


@dataclass(frozen=True)
class TrainBatch:
    """Everything the loss needs, per sequence, staged once before the first update.

    Per-token fields are lists aligned with `sequences`, each tensor [response_len]."""

    sequences: list[TrainSequence]
    advantages: torch.Tensor  # [N] float32
    old_logprobs: list[torch.Tensor] | None  # None: the training forward's own (`forward`)
    ref_logprobs: list[torch.Tensor] | None  # None without a KL term
    tis_weights: list[torch.Tensor] | None  # None with TIS off, or until the forward
    # This rank's micro-batches of all `sequences`, built once for the logprob passes and
    # reused by a mini-batch that is the whole batch (building them is CPU work on the
    # trainer's critical path: ~0.8 s per build at the original recipe's 2,560 samples).
    microbatches: list[MicroBatch] | None = None
    # `forward` with rollout logprobs: the TIS weights and the trainer-vs-rollout metrics
    # are computed in the loss, from the training forward's logprobs.
    rollout_logprobs: list[torch.Tensor] | None = None


def build_sequences(
    trajectories: Sequence[Trajectory], cfg: TrainerConfig
) -> tuple[list[TrainSequence], torch.Tensor, dict[str, float]]:
    """Sequences ordered by group (so mini-batches keep groups together), their advantages,
    and the reward metrics. Degenerate groups are dropped here when configured."""
    infra = sum(t.infrastructure_failure for t in trajectories)
    if not cfg.loss.train_on_infrastructure_failures:
        trajectories = [t for t in trajectories if not t.infrastructure_failure]
    order = sorted(range(len(trajectories)), key=lambda i: (trajectories[i].group_id, i))
    sequences: list[TrainSequence] = []
    nonfinite = 0
    for i in order:
        s, bad = sequence_from_trajectory(trajectories[i])
        sequences.append(s)
        nonfinite += bad
    adv = group_advantages(
        [s.reward for s in sequences], [s.group_id for s in sequences], cfg.advantages
    )
    advantages = adv.advantages.to(torch.float32)
    # Reward statistics over everything consumed, before any filtering.
    rewards = [s.reward for s in sequences] or [0.0]
    ems = [s.em for s in sequences if s.em is not None]
    if cfg.advantages.filter_degenerate_groups and sequences:
        keep = ~adv.degenerate
        sequences = [s for s, k in zip(sequences, keep.tolist(), strict=True) if k]
        advantages = advantages[keep]
    resp = [s.response_len for s in sequences] or [0]
    masked = sum(float(s.loss_mask.sum()) for s in sequences)
    total_resp = sum(resp)
    metrics = {
        "samples": float(len(sequences)),
        "groups": float(adv.num_groups),
        "groups/degenerate": float(adv.num_degenerate_groups),
        "groups/degenerate_fraction": adv.num_degenerate_groups / max(adv.num_groups, 1),
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "advantages/mean": float(advantages.mean()) if advantages.numel() else 0.0,
        "advantages/abs_mean": float(advantages.abs().mean()) if advantages.numel() else 0.0,
        "response_length/mean": statistics.fmean(resp),
        "response_length/max": float(max(resp)),
        # Response tokens that are retrieved text (loss mask 0): if it dominates, little trains.
        "loss_mask/observation_fraction": 1.0 - masked / total_resp if total_resp else 0.0,
        "nonfinite_rollout_logprobs": float(nonfinite),
        "samples/infrastructure_failures": float(infra),
    }
    if ems:
        metrics["reward/em"] = statistics.fmean(ems)
    return sequences, advantages, metrics


def rank_microbatches(
    sequences: Sequence[TrainSequence], backend: TrainerBackend, cfg: TrainerConfig
) -> list[MicroBatch]:
    """This data-parallel rank's packed micro-batches; a dummy one where it has none left
    (every rank runs the same number of forwards: the collectives are per forward)."""
    b = cfg.batch
    plan = plan_microbatches(
        [s.length for s in sequences],
        b.max_tokens_per_microbatch,
        packed=b.packing,
        max_samples=b.max_samples_per_microbatch,
    )
    return [
        build_microbatch(sequences, idxs, packed=b.packing) if idxs else dummy_microbatch()
        for idxs in shard_plan(plan, backend.dp_size, backend.dp_rank)
    ]


def sequence_logprobs(
    sequences: Sequence[TrainSequence],
    backend: TrainerBackend,
    policy: Policy,
    cfg: TrainerConfig,
    microbatches: list[MicroBatch] | None = None,
) -> list[torch.Tensor]:
    """Per-sequence logprobs of the response tokens under `policy`, on every rank
    (`microbatches`: this rank's of `sequences`, when already built)."""
    mbs = rank_microbatches(sequences, backend, cfg) if microbatches is None else microbatches
    local: dict[int, torch.Tensor] = {}
    for mb, logp in zip(mbs, backend.logprobs(mbs, policy), strict=True):
        if not mb.samples:  # a rank's dummy micro-batch (it ran out of samples)
            continue
        # A micro-batch's tokens run sample by sample (MicroBatch.sample_index is sorted).
        # Cloned: pickled for the all-gather, a view would carry its whole storage.
        parts = [p.clone() for p in logp.split([sequences[i].response_len for i in mb.samples])]
        local.update(zip(mb.samples, parts, strict=True))
    merged: dict[int, torch.Tensor] = {}
    for part in backend.all_gather_dp(local):
        merged.update(part)
    return [merged[i] for i in range(len(sequences))]


def stage_batch(
    sequences: list[TrainSequence],
    advantages: torch.Tensor,
    backend: TrainerBackend,
    cfg: TrainerConfig,
) -> tuple[TrainBatch, dict[str, float]]:
    """Old-policy and reference logprobs and TIS weights: the finished `TrainBatch`."""
    metrics: dict[str, float] = {}
    rollout = [s.rollout_logprobs for s in sequences]
    have_rollout = all(r is not None for r in rollout)
    source = cfg.loss.old_logprobs
    forward = source == OldLogprobSource.FORWARD
    recompute = source == OldLogprobSource.RECOMPUTE or (
        source == OldLogprobSource.ROLLOUT and not have_rollout
    )
    need = recompute or cfg.loss.kl_coef > 0
    mbs = rank_microbatches(sequences, backend, cfg) if need else None
    old: list[torch.Tensor] | None = None
    if source == OldLogprobSource.ROLLOUT and have_rollout:
        old = [r for r in rollout if r is not None]
    elif recompute:
        if cfg.loss.old_logprobs == OldLogprobSource.ROLLOUT:
            metrics["old_logprobs_recomputed"] = 1.0  # some trajectory had no rollout logprobs
        old = sequence_logprobs(sequences, backend, Policy.CURRENT, cfg, mbs)
    ref = None
    if cfg.loss.kl_coef > 0:
        ref = sequence_logprobs(sequences, backend, Policy.REFERENCE, cfg, mbs)
    if forward:
        loss_side = [r for r in rollout if r is not None] if sequences and have_rollout else None
        return TrainBatch(sequences, advantages, None, ref, None, mbs, loss_side), metrics
    assert old is not None
    tis = None
    if sequences and have_rollout:
        mask = torch.cat([s.loss_mask for s in sequences]) > 0
        flat_old = torch.cat(old)
        flat_rollout = torch.cat([r for r in rollout if r is not None])
        if cfg.loss.old_logprobs == OldLogprobSource.RECOMPUTE:
            diff = MismatchSums()
            diff.add_diff(flat_old, flat_rollout, mask)
            metrics.update(diff.diff_metrics())
        if cfg.tis.mode != TISMode.OFF:
            res = tis_weights(
                flat_old, flat_rollout, mask, _token_index(sequences), len(sequences), cfg.tis
            )
            tis = list(torch.split(res.weights, [s.response_len for s in sequences]))
            metrics.update(res.metrics)
    batch = TrainBatch(sequences, advantages, old, ref, tis, mbs)
    return batch, metrics


def _token_index(sequences: Sequence[TrainSequence]) -> torch.Tensor:
    """The index of its sequence for every response token, concatenated."""
    return torch.cat(
        [torch.full((s.response_len,), k, dtype=torch.long) for k, s in enumerate(sequences)]
    )


def minibatch_loss(
    batch: TrainBatch,
    idxs: list[int],
    weights: list[torch.Tensor],
    cfg: TrainerConfig,
    mismatch: MismatchSums | None = None,
) -> LossFn:
    """The GRPO loss of a micro-batch of the mini-batch `idxs` (positions in `batch`), whose
    micro-batches index `idxs` in order; `weights` are the mini-batch's aggregation weights.
    With `batch.rollout_logprobs` (`forward`), `mismatch` collects the TIS and trainer-vs-
    rollout sums of the micro-batches."""
    sub = [batch.sequences[i] for i in idxs]
    adv = [
        torch.full((s.response_len,), float(batch.advantages[i]))
        for s, i in zip(sub, idxs, strict=True)
    ]
    old = [batch.old_logprobs[i] for i in idxs] if batch.old_logprobs is not None else None
    ref = [batch.ref_logprobs[i] for i in idxs] if batch.ref_logprobs is not None else None
    tis = [batch.tis_weights[i] for i in idxs] if batch.tis_weights is not None else None
    rollout = None
    if batch.rollout_logprobs is not None:
        rollout = [batch.rollout_logprobs[i] for i in idxs]
        masks = [s.loss_mask for s in sub]

    def loss_fn(mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor | None) -> LossTerms:
        dev = logp.device

        def pick(per_sequence: Sequence[torch.Tensor]) -> torch.Tensor:
            if not mb.samples:  # the dummy micro-batch of a rank without data: zero weight
                return torch.zeros(mb.targets.numel())
            return mb.gather(per_sequence)

        # `forward`: the old policy is this very forward's (the same weights), detached.
        old_logp = pick(old).to(dev) if old is not None else logp.detach()
        tis_w = pick(tis) if tis is not None else None
        if rollout is not None:
            assert mismatch is not None
            old_cpu = old_logp.float().cpu()
            tis_w = mismatch.add(old_cpu, pick(rollout), pick(masks) > 0, cfg.tis)
        return grpo_loss(
            logp,
            old_logp,
            pick(adv).to(dev),
            pick(weights).to(dev),
            cfg.loss,
            ref_logp=pick(ref).to(dev) if ref is not None else None,
            entropy=entropy,
            tis_weights=tis_w.to(dev) if tis_w is not None else None,
        )

    return loss_fn


def _summing_metrics(loss_fn: LossFn, sums: dict[str, float]) -> LossFn:
    """`loss_fn`, adding each micro-batch's (weighted) metrics into `sums`."""

    def summed(mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor | None) -> LossTerms:
        terms = loss_fn(mb, logp, entropy)
        for k, v in terms.metrics.items():
            sums[k] = sums.get(k, 0.0) + v
        return terms

    return summed


def train_batch(batch: TrainBatch, backend: TrainerBackend, cfg: TrainerConfig) -> dict[str, float]:
    """`num_minibatches` optimizer steps over the staged batch; returns averaged metrics."""
    totals: dict[str, float] = {}
    minibatches = split_minibatches(len(batch.sequences), cfg.batch.num_minibatches)
    t_fb = t_opt = 0.0
    tokens = 0.0
    for idxs in minibatches:
        sub = [batch.sequences[i] for i in idxs]
        # Weights normalised over the whole mini-batch (all ranks): accumulation and data
        # parallelism then give the update of one big batch.
        mask = torch.cat([s.loss_mask for s in sub])
        w = aggregation_weights(mask, _token_index(sub), len(sub), cfg.loss.aggregation)
        weights = list(torch.split(w, [s.response_len for s in sub]))
        sums: dict[str, float] = {}
        mismatch = MismatchSums() if batch.rollout_logprobs is not None else None
        loss_fn = _summing_metrics(minibatch_loss(batch, idxs, weights, cfg, mismatch), sums)
        whole = len(idxs) == len(batch.sequences) and batch.microbatches is not None
        mbs = batch.microbatches if whole else rank_microbatches(sub, backend, cfg)
        assert mbs is not None
        tokens += sum(mb.num_tokens for mb in mbs)
        t0 = time.perf_counter()
        backend.forward_backward(mbs, loss_fn, entropy_grad=cfg.loss.entropy_coef > 0)
        t1 = time.perf_counter()
        step = backend.optimizer_step()
        t_opt += time.perf_counter() - t1
        t_fb += t1 - t0
        sums = backend.all_reduce_dp(sums)
        if mismatch is not None:  # only with one mini-batch (TrainerConfig checks)
            sums |= MismatchSums.metrics(backend.all_gather_dp(mismatch), cfg.tis)
        sums["grad_norm"] = step.grad_norm
        sums["lr"] = step.lr
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + v
    # Once per training step, as in verl (Search-R1): `warmup_steps` are training steps like
    # every other `*_steps` of the config, whatever `num_minibatches` is.
    backend.scheduler_step()
    n = len(minibatches)
    metrics = {k: v if k in _COUNTS else v / n for k, v in totals.items()}
    metrics["optimizer_steps"] = float(n)
    metrics["time/forward_backward_s"] = t_fb
    metrics["time/optimizer_s"] = t_opt
    metrics["train_tokens"] = backend.all_reduce_dp({"t": tokens})["t"]
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
    sequences, advantages, metrics = build_sequences(valid, cfg)
    metrics["invalid_samples"] = float(len(trajectories) - len(valid))
    if not sequences:
        metrics["skipped"] = 1.0
        return metrics
    t0 = time.perf_counter()
    batch, staged = stage_batch(sequences, advantages, backend, cfg)
    metrics.update(staged)
    metrics["time/logprobs_s"] = time.perf_counter() - t0  # old/ref forward passes, TIS
    metrics.update(train_batch(batch, backend, cfg))
    return metrics
