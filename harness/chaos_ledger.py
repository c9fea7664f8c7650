"""The chaos bench's ledger: what was published against what the trainer's checkpoints hold.

Published ids come from the bus stream itself, read by a tap outside the loop
(`harness/chaos_tap.py`: every XADD as Redis runs it, entries added unseen counted as
`unseen`). Trained ids come from the trainer's checkpoints, read as they are made
(`CheckpointWatch`): each checkpoint's `trainer.json` holds the bus receipts of every trajectory
trained since the checkpoint before it, and `latest` names the one a restart resumes from. A
resume from an older checkpoint makes its later steps again: a checkpoint at a step replaces
the ones at that step and after (they held a model that was thrown away), which is what "the
lineage" below keeps. Neither source is written by the orchestrator about itself, and what the
trainer logs (`metrics_jsonl`'s step lines) is only compared (`unlogged`): a component that
loses data and its own record of it together shows as lost.
"""

from __future__ import annotations

import bisect
import contextlib
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


class CheckpointWatch:
    """Polled (`poll`) while the run goes: a record `{step, trajectory_ids}` each time `latest`
    names a checkpoint not read before (or a rewritten one: a step made again after a resume).
    A checkpoint pruned before a poll saw it would leave its ids out of the trained set: they
    show as lost, never as a pass (checkpoints live two checkpoint intervals, polls are 0.25 s
    apart)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.records: list[dict[str, Any]] = []
        self._last = b""

    def poll(self) -> None:
        with contextlib.suppress(OSError, ValueError, KeyError):  # none yet, or mid-prune
            name = (self.root / "latest").read_text().strip()
            raw = (self.root / name / "trainer.json").read_bytes()
            if name.encode() + raw == self._last:
                return
            state = json.loads(raw)
            ids = [str(receipt[1]) for receipt in state["receipts"]]
            self.records.append({"step": int(state["step"]), "trajectory_ids": ids})
            self._last = name.encode() + raw


@dataclass
class LedgerResult:
    published: int
    trained: int
    lost: list[str] = field(default_factory=list)  # published, not trained (dead letters too)
    duplicated: list[str] = field(default_factory=list)  # trained twice in the final lineage
    dead: dict[str, str] = field(default_factory=dict)  # of the lost: dead-lettered id -> reason
    unpublished: list[str] = field(default_factory=list)  # trained, never seen on the stream
    unseen: int = 0  # stream entries added that the tap could not identify
    unlogged: list[str] = field(default_factory=list)  # in a checkpoint, in no step line
    rewinds: int = 0  # checkpoints replaced by a resume from an older one
    steps: int = 0  # the last checkpoint's step


def settle(
    published: set[str],
    checkpoints: list[dict[str, Any]],
    *,
    logged: list[dict[str, Any]],
    dead: dict[str, str],
    unseen: int = 0,
) -> LedgerResult:
    """Compare what was published with what the final model was trained on.

    `checkpoints`: `CheckpointWatch.records`; `logged`: the trainer's step lines (`read_steps`),
    only to name the checkpointed ids no step line mentions (a trainer killed between its
    checkpoint and its line). `dead`: the dead-letter stream's id -> reason.
    """
    kept = lineage(checkpoints)
    counts = Counter(tid for ids in kept.values() for tid in ids)
    trained = set(counts)
    logged_ids = {tid for ids in lineage(logged).values() for tid in ids}
    return LedgerResult(
        published=len(published),
        trained=len(trained),
        lost=sorted(published - trained),
        duplicated=sorted(t for t, n in counts.items() if n > 1),
        dead={t: r for t, r in dead.items() if t in published and t not in trained},
        unpublished=sorted(trained - published),
        unseen=unseen,
        unlogged=sorted(trained - logged_ids),
        rewinds=len(checkpoints) - len(kept),
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
