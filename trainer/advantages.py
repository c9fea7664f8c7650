"""GRPO group-normalized advantages (spec section 5)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.config import AdvantageConfig


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: torch.Tensor  # [num_samples] float32, one scalar per sample
    degenerate: torch.Tensor  # [num_samples] bool: the sample's group has all-equal rewards
    num_groups: int
    num_degenerate_groups: int


def group_advantages(
    rewards: Sequence[float] | torch.Tensor, group_ids: Sequence[str], cfg: AdvantageConfig
) -> GroupAdvantages:
    """`(r - mean_g) / (std_g + eps)` with the unbiased std of the sample's group g.

    With `normalize_std=False` (Dr.GRPO) the std division is dropped. A group whose rewards are
    all equal (including a group of one) gets zero advantage and is reported as degenerate.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() != len(group_ids):
        raise ValueError(f"{r.numel()} rewards for {len(group_ids)} group ids")
    index: dict[str, int] = {}
    gidx = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    n_groups = len(index)
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gidx, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gidx, r) / count
    dev = r - mean[gidx]
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gidx, dev * dev)
    # Unbiased (n - 1); a single-sample group has no spread, its std is taken as 0.
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq))
    std = var.sqrt()
    # Exact comparison of the raw rewards: a float mean of equal values can be off by an ulp.
    spread: dict[int, set[float]] = {}
    for g, v in zip(gidx.tolist(), r.tolist(), strict=True):
        spread.setdefault(g, set()).add(v)
    degenerate_group = torch.tensor(
        [len(spread[g]) == 1 for g in range(n_groups)], dtype=torch.bool
    )  # dtype: an empty list would make a float tensor
    adv = dev / (std[gidx] + cfg.eps) if cfg.normalize_std else dev
    degenerate = degenerate_group[gidx]
    adv = torch.where(degenerate, torch.zeros_like(adv), adv)
    return GroupAdvantages(
        advantages=adv.to(torch.float32),
        degenerate=degenerate,
        num_groups=n_groups,
        num_degenerate_groups=int(degenerate_group.sum()),
    )
