"""The chaos bench's ledger: which trajectories were published, which trained, across restarts.

Published ids come from the bus stream itself (polled while the run goes: an entry lives until
the checkpoint after it is trained) and the orchestrator's published-group markers. Trained ids
come from the trainer's `metrics_jsonl`, one record per step with its `trajectory_ids`. A
restarted trainer resumes from its last checkpoint, so it may write a step number again: that
record replaces the earlier one and every later one (they trained a model that was thrown
away), which is what "the lineage" below keeps.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a SIGKILL: that step was not logged
            continue
    return rows


def lineage(records: list[dict[str, Any]]) -> dict[int, list[str]]:
    """step -> trajectory ids of the steps that made the final model."""
    kept: dict[int, list[str]] = {}
    for rec in records:
        step = int(rec["step"])
        for later in [s for s in kept if s >= step]:  # a resume from an older checkpoint
            del kept[later]
        kept[step] = list(rec.get("trajectory_ids", []))
    return kept


@dataclass
class LedgerResult:
    published: int
    trained: int
    lost: list[str] = field(default_factory=list)  # published, not trained (dead letters too)
    duplicated: list[str] = field(default_factory=list)  # trained in two different steps
    dead: dict[str, str] = field(default_factory=dict)  # of the lost: dead-lettered id -> reason
    unlogged: list[str] = field(default_factory=list)  # acked, trained, step line not written
    rewinds: int = 0  # records replaced by a resume from an older checkpoint
    steps: int = 0


def settle(
    published: set[str],
    records: list[dict[str, Any]],
    *,
    acked: set[str],
    dead: dict[str, str],
) -> LedgerResult:
    """Compare what was published with what the final model was trained on.

    `acked` is the bus's done set (ids whose training is durable, dead letters included):
    an id acked but in no step record was trained by a trainer killed between its checkpoint
    and writing the step's line.
    """
    kept = lineage(records)
    counts = Counter(tid for ids in kept.values() for tid in set(ids))
    trained = set(counts)
    unlogged = sorted((acked & published) - trained - set(dead))
    lost = sorted(published - trained - set(unlogged))
    return LedgerResult(
        published=len(published),
        trained=len(trained),
        lost=lost,
        duplicated=sorted(t for t, n in counts.items() if n > 1),
        dead={t: r for t, r in dead.items() if t in published},
        unlogged=unlogged,
        rewinds=len(records) - len(kept),
        steps=max(kept, default=0),
    )


def split_brain_steps(
    records: list[dict[str, Any]], holders: list[tuple[float, str | None]]
) -> list[int]:
    """Steps logged by a trainer while the run's lease was held by another one.

    `holders`: the lease's holder ("host:pid", None when free) as polled, (Unix time, holder)
    in time order. A step counts only when the last poll before its time and the first after
    it both name the same other holder, so a step logged just before a takeover is not one.
    Records without `trainer` or `time` (older trainers) are not judged.
    """
    times = [t for t, _ in holders]
    out = []
    for rec in records:
        who, when = rec.get("trainer"), rec.get("time")
        if who is None or when is None:
            continue
        i = bisect.bisect_right(times, when)
        if i == 0 or i == len(times):
            continue
        before, after = holders[i - 1][1], holders[i][1]
        if before is not None and before == after and before != who:
            out.append(int(rec["step"]))
    return out
