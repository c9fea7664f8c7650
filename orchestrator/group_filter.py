"""Dynamic sampling: which scored groups are worth training on (`rollout.group_filter`).

A group whose rewards are all equal has advantage 0 for every sample: it costs a rollout and a
training slot and teaches nothing (DAPO's dynamic sampling; slime's
`--dynamic-sampling-filter-path`). A filter takes the scored group (`list[Sample]`) and returns
True to keep it; groups it rejects are never published, counted in
`searchr1_rollout_groups_skipped_total{reason="filtered"}` and kept in the rollout log.
Built-in: `reward_std` (keep groups whose rewards differ). Or a dotted path `pkg.mod:fn`.
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.hooks import load_hook
from orchestrator.sample import Sample

GroupFilter = Callable[[list[Sample]], bool]


def reward_std(group: list[Sample]) -> bool:
    """Keep a group whose rewards are not all equal (standard deviation > 0)."""
    return len({s.reward for s in group}) > 1


BUILTIN_FILTERS: dict[str, GroupFilter] = {"reward_std": reward_std}


def load_group_filter(name: str | None) -> GroupFilter | None:
    """The filter `rollout.group_filter` names (None: keep every group). A dotted path is
    imported and signature-checked now, so a typo fails at start-up."""
    if name is None:
        return None
    if name in BUILTIN_FILTERS:
        return BUILTIN_FILTERS[name]
    return load_hook(name, field="rollout.group_filter", n_args=1, is_async=False)
