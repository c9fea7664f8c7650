"""Reading a run directory: what the trainer, the orchestrator's rollout log and the demo wrote
(the layout and the columns are the contract in `searchr1.rundir`).

Everything is read lazily and cached by file size and mtime, so a page of a live run costs
only what changed since the last one: JSON lines are read from where the last read stopped,
and a step's Parquet file is summarized once (a finished file is never rewritten).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from searchr1.rundir import (
    CONFIGS,
    EVAL,
    EVAL_SUMMARIES,
    KINDS,
    METRICS_TRAJECTORY_IDS,
    SUMMARY_COLUMNS,
    TRAIN,
    TRAIN_METRICS,
    Col,
    RunLayout,
    step_stem,
)


class JsonlTail:
    """The records of a JSON-lines file another process appends to; re-reads only new lines."""

    def __init__(self, path: Path, drop: tuple[str, ...] = ()) -> None:
        self.path = path
        self.drop = drop
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._lock = threading.Lock()

    def read(self) -> list[dict[str, Any]]:
        with self._lock:
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                self.records, self._offset = [], 0
                return self.records
            if size < self._offset:  # truncated or replaced: start over
                self.records, self._offset = [], 0
            if size > self._offset:
                with self.path.open("rb") as f:
                    f.seek(self._offset)
                    chunk = f.read(size - self._offset)
                end = chunk.rfind(b"\n") + 1  # a half-written last line waits for next time
                for line in chunk[:end].splitlines():
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue  # a corrupt line must not hide the rest of the run
                    if isinstance(record, dict):
                        for key in self.drop:
                            record.pop(key, None)
                        self.records.append(record)
                self._offset += end
            return self.records


@dataclass(frozen=True)
class Ref:
    """Where a logged trajectory lives: `<kind>/<file stem>/<trajectory_id>` in URLs.

    Trajectory ids alone are not unique in the log: every evaluation of the fixed validation
    subset produces the same ids."""

    kind: str  # train | eval
    stem: str
    trajectory_id: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.stem}/{self.trajectory_id}"

    @classmethod
    def parse(cls, text: str) -> Ref | None:
        kind, _, rest = text.partition("/")
        stem, _, tid = rest.partition("/")
        if kind not in KINDS or not stem or not tid or "." in stem:
            return None
        return cls(kind, stem, tid)


class RunDir:
    """The run directory's contents as plain Python data (no HTTP here)."""

    def __init__(self, path: Path, metrics_file: str = TRAIN_METRICS) -> None:
        self.path = Path(path)
        self.layout = RunLayout(self.path)
        self.rollouts = self.layout.rollouts
        # Each line lists every trajectory id it trained on: kept out of memory.
        self._metrics = JsonlTail(self.path / metrics_file, drop=(METRICS_TRAJECTORY_IDS,))
        self._steps = JsonlTail(self.layout.steps)
        self._evals = JsonlTail(self.layout.evals)
        self._summaries: dict[Path, tuple[tuple[int, int], list[dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    # -- JSON lines -----------------------------------------------------------------------------

    def train_metrics(self) -> list[dict[str, Any]]:
        return self._metrics.read()

    def rollout_steps(self) -> list[dict[str, Any]]:
        """In step order: async steps overlap, so a later step can finish (and be logged)
        before an earlier one; a re-run step's records keep their order."""
        return sorted(self._steps.read(), key=lambda r: r.get("step", 0))

    def evaluations(self) -> list[dict[str, Any]]:
        """Logged evaluations, else the demo's `eval_*.json` summaries (no samples)."""
        logged = self._evals.read()
        if logged:
            return logged
        out = []
        for f in sorted(self.path.glob(EVAL_SUMMARIES), key=lambda p: p.stat().st_mtime):
            try:
                data = json.loads(f.read_text())
            except ValueError:
                continue
            out.append({"eval_id": "", "label": f.stem, "step": -1, **data})
        return out

    def config_text(self) -> str:
        parts = [f"# {f.name}\n{f.read_text()}" for f in sorted(self.path.glob(CONFIGS))]
        return "\n".join(parts)

    def step_record(self, step: int) -> dict[str, Any] | None:
        return next((r for r in self.rollout_steps() if r.get("step") == step), None)

    # -- Parquet --------------------------------------------------------------------------------

    def _file(self, kind: str, stem: str) -> Path:
        if "/" in stem or stem.startswith("."):
            raise ValueError(f"not a file of the rollout log: {stem!r}")
        return self.layout.parquet(kind, stem)

    def _summary(self, path: Path) -> list[dict[str, Any]]:
        """The list columns of one file, cached by (size, mtime)."""
        try:
            st = path.stat()
        except FileNotFoundError:
            return []
        key = (st.st_size, st.st_mtime_ns)
        with self._lock:
            cached = self._summaries.get(path)
        if cached and cached[0] == key:
            return cached[1]
        rows = pq.read_table(path, columns=list(SUMMARY_COLUMNS)).to_pylist()
        kind, stem = path.parent.name, path.stem
        for row in rows:
            row["ref"] = str(Ref(kind, stem, row[Col.TRAJECTORY_ID]))
            row[Col.REWARD_COMPONENTS] = dict(row[Col.REWARD_COMPONENTS] or [])
        with self._lock:
            self._summaries[path] = (key, rows)
        return rows

    def files(self, kind: str | None = None) -> list[Path]:
        kinds = [kind] if kind else list(KINDS)
        return [f for k in kinds for f in sorted((self.rollouts / k).glob("*.parquet"))]

    def trajectories(
        self,
        *,
        kind: str | None = None,
        step: int | None = None,
        eval_id: str | None = None,
        text: str | None = None,
    ) -> list[dict[str, Any]]:
        """Summary rows of logged trajectories; `text` searches the question and the response
        (case-insensitive), reading only the files that still match."""
        if eval_id:
            files = [self._file(EVAL, eval_id)]
        elif step is not None and kind != EVAL:
            files = [self._file(TRAIN, step_stem(step))]
        else:
            files = self.files(kind)
        out = []
        for f in files:
            rows = self._summary(f)
            if step is not None:
                rows = [r for r in rows if r[Col.STEP] == step]
            if text:
                columns = [Col.TRAJECTORY_ID, Col.QUESTION, Col.RESPONSE_TEXT]
                table = pq.read_table(f, columns=columns)
                hit = pc.or_(
                    pc.match_substring(table[Col.QUESTION], text, ignore_case=True),
                    pc.match_substring(table[Col.RESPONSE_TEXT], text, ignore_case=True),
                )
                ids = set(table.filter(hit)[Col.TRAJECTORY_ID].to_pylist())
                rows = [r for r in rows if r[Col.TRAJECTORY_ID] in ids]
            out += rows
        return out

    def trajectory(self, ref: Ref) -> dict[str, Any] | None:
        path = self._file(ref.kind, ref.stem)
        if not path.exists():
            return None
        table = pq.read_table(path, filters=[(Col.TRAJECTORY_ID, "=", ref.trajectory_id)])
        if not table.num_rows:
            return None
        row = table.slice(0, 1).to_pylist()[0]
        row["ref"] = str(ref)
        row[Col.REWARD_COMPONENTS] = dict(row[Col.REWARD_COMPONENTS] or [])
        return row

    def eval_rows(self, eval_id: str) -> list[dict[str, Any]]:
        return self._summary(self._file(EVAL, eval_id))
