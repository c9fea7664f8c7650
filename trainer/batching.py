"""Trajectories -> training samples -> micro-batches.

Packing: the sequences of a micro-batch are concatenated into one row with `position_ids`
restarting at 0 for each; transformers 5.x derives a block-diagonal causal mask from such
position ids (no attention mask, no KV cache), so no compute is spent on padding. The padded
path (right padding + attention mask) exists for comparison and as a fallback.

Only the rows whose logits are needed (the positions predicting response tokens) go through the
LM head (`logits_to_keep` with explicit indices), in both paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from protos.trajectory import Trajectory


@dataclass(frozen=True)
class TrainSequence:
    """One trajectory as the trainer needs it; per-token tensors cover the response only."""

    sample_id: str
    group_id: str
    input_ids: torch.Tensor  # int64 [L]: prompt + response
    prompt_len: int
    loss_mask: torch.Tensor  # float32 [R]; 0 on observation tokens and non-finite logprobs
    rollout_logprobs: torch.Tensor | None  # float32 [R]
    reward: float
    em: float | None = None  # the exact-match reward component, when the reward has one
    # The logits are divided by it: the engine sampled from (and scored with) logits / T.
    temperature: float = 1.0

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    @property
    def length(self) -> int:
        return len(self.input_ids)


# SGLang's greedy threshold (`_SAMPLING_EPS`): such samples carry temperature-1 logprobs.
_GREEDY_EPS = 1e-6


def _mask_array(mask: bytes | Sequence[int]) -> np.ndarray:
    # The wire format is one byte per token.
    if isinstance(mask, bytes | bytearray):
        return np.frombuffer(mask, dtype=np.uint8).astype(np.float32)
    return np.array(mask, dtype=np.float32)


def sequence_from_trajectory(traj: Trajectory) -> tuple[TrainSequence, int]:
    """Convert one trajectory; returns the sequence and how many non-finite rollout logprobs
    were masked out of it."""
    # numpy, not torch, per trajectory: it reads protobuf's repeated fields in C (~30x faster
    # than list() then torch.tensor) and has no per-op dispatch cost on these small arrays;
    # both cost the trainer ~1 s a step at 2,048 samples (bench/pipeline.py, slime64).
    prompt_len = len(traj.prompt_token_ids)
    input_ids = np.concatenate(
        [
            np.array(traj.prompt_token_ids, dtype=np.int64),
            np.array(traj.response_token_ids, dtype=np.int64),
        ]
    )
    mask = _mask_array(traj.loss_mask)
    rollout = None
    nonfinite = 0
    if traj.has_rollout_logprobs:
        rollout = np.array(traj.rollout_logprobs, dtype=np.float32)
        finite = np.isfinite(rollout)
        bad = ~finite & (mask > 0)
        nonfinite = int(bad.sum())
        mask[bad] = 0.0
        rollout[~finite] = 0.0
    if not prompt_len and len(mask):
        # Nothing predicts the first token of a prompt-less sequence.
        mask[0] = 0.0
    components = dict(traj.reward.components)
    sequence = TrainSequence(
        sample_id=traj.trajectory_id,
        group_id=traj.group_id,
        input_ids=torch.from_numpy(input_ids),
        prompt_len=prompt_len,
        loss_mask=torch.from_numpy(mask),
        rollout_logprobs=None if rollout is None else torch.from_numpy(rollout),
        reward=float(traj.reward.total),
        em=components.get("em"),
        # 0 = greedy or unset (an older producer): SGLang's greedy logprobs are temperature 1.
        temperature=traj.temperature if traj.temperature >= _GREEDY_EPS else 1.0,
    )
    return sequence, nonfinite


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor | None  # [B, L] for the padded path; None when packed
    cu_seqlens: torch.Tensor | None  # [n + 1] sequence boundaries in the packed row
    keep_positions: torch.Tensor  # [K] sequence positions whose logits are computed
    row_batch: torch.Tensor  # [T] batch row of the logits predicting each response token
    row_keep: torch.Tensor  # [T] index into keep_positions of that logits row
    targets: torch.Tensor  # [T] the response tokens
    sample_index: torch.Tensor  # [T] index into `samples` of each response token
    temperatures: torch.Tensor  # [T] float32, the sampling temperature of each response token
    samples: list[int]  # indices into the caller's sequence list, in order
    num_tokens: int  # real (non-padding) tokens
    padded_tokens: int  # B * L

    def gather(self, per_sequence: Sequence[torch.Tensor]) -> torch.Tensor:
        """This micro-batch's tokens of a per-sequence response tensor, in token order."""
        return torch.cat([per_sequence[i] for i in self.samples])


def plan_microbatches(
    lengths: Sequence[int], budget: int, *, packed: bool = True, max_samples: int | None = None
) -> list[list[int]]:
    """Group sample indices into micro-batches of at most `budget` tokens.

    Packed: first-fit decreasing on real tokens. Padded: arrival order, batch size bounded by
    `B * max_len <= budget` (the cost a padded forward really pays). A sample longer than the
    budget gets a micro-batch of its own. `max_samples` also caps the samples per micro-batch.
    """
    cap = max_samples or len(lengths) or 1
    if packed:
        bins: list[list[int]] = []
        loads: list[int] = []
        for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
            for b, load in enumerate(loads):
                if load + lengths[i] <= budget and len(bins[b]) < cap:
                    bins[b].append(i)
                    loads[b] += lengths[i]
                    break
            else:
                bins.append([i])
                loads.append(lengths[i])
        return [sorted(b) for b in bins]
    out: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i, n in enumerate(lengths):
        new_max = max(cur_max, n)
        if cur and (new_max * (len(cur) + 1) > budget or len(cur) >= cap):
            out.append(cur)
            cur, new_max = [], n
        cur.append(i)
        cur_max = new_max
    if cur:
        out.append(cur)
    return out


def build_microbatch(
    samples: Sequence[TrainSequence], idxs: Sequence[int], *, packed: bool, pad_id: int = 0
) -> MicroBatch:
    """One micro-batch of `samples[idxs]`, built with one tensor op per sequence (never per
    token: at the original recipe's batch, 2.7M tokens, a per-token loop took ~2 s of the
    trainer's CPU per build, three builds per step; found by bench/pipeline.py)."""
    seqs = [samples[i] for i in idxs]
    ids_t = [torch.as_tensor(s.input_ids, dtype=torch.long) for s in seqs]
    if packed:
        input_ids = torch.cat(ids_t).unsqueeze(0)
        position_ids = torch.cat([torch.arange(s.length) for s in seqs]).unsqueeze(0)
        attention_mask = None
        lengths = torch.tensor([s.length for s in seqs], dtype=torch.long)
        offsets = torch.cumsum(lengths, 0)
        starts = (offsets - lengths).tolist()
        rows = [0] * len(seqs)
        cu_seqlens = torch.tensor([*starts, int(offsets[-1])], dtype=torch.int32)
    else:
        width = max(s.length for s in seqs)
        input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, (s, ids) in enumerate(zip(seqs, ids_t, strict=True)):
            input_ids[b, : s.length] = ids
            attention_mask[b, : s.length] = 1
        position_ids = torch.arange(width).expand(len(seqs), width).contiguous()
        starts = [0] * len(seqs)
        rows = list(range(len(seqs)))
        cu_seqlens = None
    # The logits at position j predict token j + 1: response token j is predicted at j - 1.
    row_batch, row_pos, targets, sample_index, temps = [], [], [], [], []
    for k, (s, ids, start, row) in enumerate(zip(seqs, ids_t, starts, rows, strict=True)):
        n = s.response_len
        row_batch.append(torch.full((n,), row, dtype=torch.long))
        row_pos.append(start + torch.arange(s.prompt_len - 1, s.length - 1).clamp_(min=0))
        targets.append(ids[s.prompt_len :])
        sample_index.append(torch.full((n,), k, dtype=torch.long))
        temps.append(torch.full((n,), s.temperature, dtype=torch.float32))
    pos_t = torch.cat(row_pos)
    keep, row_keep = torch.unique(pos_t, sorted=True, return_inverse=True)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        keep_positions=keep,
        row_batch=torch.cat(row_batch),
        row_keep=row_keep,
        targets=torch.cat(targets),
        sample_index=torch.cat(sample_index),
        temperatures=torch.cat(temps),
        samples=list(idxs),
        num_tokens=sum(s.length for s in seqs),
        padded_tokens=int(input_ids.numel()),
    )


# A rank with no micro-batch left still joins the collectives (FSDP's, DP's), with zero weight.
DUMMY = TrainSequence(
    "dummy", "dummy", torch.zeros(2, dtype=torch.long), 1, torch.zeros(1), None, 0.0
)


def dummy_microbatch() -> MicroBatch:
    """One token of no caller's sequence (`samples` empty): its loss gets zero weight."""
    return replace(build_microbatch([DUMMY], [0], packed=True), samples=[], num_tokens=0)


def shard_plan(plan: list[list[int]], world_size: int, rank: int) -> list[list[int]]:
    """This rank's micro-batches; every rank gets the same count (FSDP collectives run per
    forward/backward), an empty list meaning a zero-weight dummy pass."""
    padded = plan + [[] for _ in range(-len(plan) % world_size)]
    return padded[rank::world_size]


def split_minibatches(n: int, num_minibatches: int) -> list[list[int]]:
    """Contiguous, near-equal split of `range(n)` (groups stay together when ordered)."""
    if num_minibatches > n:
        num_minibatches = max(n, 1)
    bounds = [round(k * n / num_minibatches) for k in range(num_minibatches + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(num_minibatches)]
