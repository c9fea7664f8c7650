"""The rollout log: a sampled subset of trajectories, as Parquet files in the run directory.

What `searchr1 inspect` reads; the file names and the Parquet schema are the run directory's
contract, `searchr1.rundir`. Layout under `<run_dir>/rollouts/`:

    train/step-000012.parquet  the logged samples of one step: `groups_per_step` whole groups
                               plus every failed, truncated or invalid sample (capped). One file
                               per step, because a Parquet file is readable only once its footer
                               is written: a reader sees every finished step while the run goes.
    steps.jsonl                one line per step: the orchestrator's step summary and the rewards
                               of *every* group (logged or not), for the step view
    eval/<eval_id>.parquet     every sample of one held-out evaluation
    evals.jsonl                one line per evaluation: id, label, step, scores

Size: when train/ holds more than `max_bytes`, the oldest step files are deleted (rotation);
evaluations are kept (one file per evaluation of the fixed validation subset).
A failed write (a full disk) is counted (`searchr1_rollout_log_failures_total`), logged once
per spell of failures, leaves no partial file, and never stops the rollouts.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from orchestrator.config import RolloutLogConfig
from orchestrator.metrics import ROLLOUT_LOG_FAILURES
from orchestrator.rewards import extract_answer
from orchestrator.sample import Sample, count_searches
from orchestrator.trajectory import to_trajectory
from protos.trajectory import FinishReason, Trajectory
from searchr1.rundir import EVAL, STEP_FILES, TRAIN, Col, RunLayout, rollout_schema

log = logging.getLogger(__name__)

_FAILED = {"error", "aborted"}
_TRUNCATED = {"truncated", "response_budget", "context_limit", "max_turns"}


class Decoder(Protocol):
    """The slice of a Hugging Face tokenizer the log needs."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def batch_decode(self, sequences: Sequence[Sequence[int]], **kw: Any) -> list[str]: ...


def mask_runs(mask: bytes) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal loss-mask bytes."""
    out, pos = [], 0
    for value, run in itertools.groupby(mask):
        n = sum(1 for _ in run)
        out.append((value, pos, pos + n))
        pos += n
    return out


def question_of(prompt_text: str) -> str:
    """The question line of a Search-R1 prompt (`Question: ...`), else the prompt's tail."""
    _, found, rest = prompt_text.rpartition("Question:")
    if found:
        return rest.strip().split("\n", 1)[0].strip()
    return prompt_text.strip()[-200:]


def trajectory_row(
    traj: Trajectory,
    tok: Decoder,
    *,
    kind: str,
    reason: str,
    eval_id: str = "",
    tis_weights: Sequence[float] | None = None,
) -> dict[str, Any]:
    """One Parquet row: the trajectory's fields plus the text the inspector shows."""
    ids = list(traj.response_token_ids)
    token_texts = tok.batch_decode([[i] for i in ids], skip_special_tokens=False) if ids else []
    response_text = tok.decode(ids, skip_special_tokens=False)
    prompt_text = tok.decode(list(traj.prompt_token_ids), skip_special_tokens=False)
    mask = bytes(traj.loss_mask)
    spans = [
        {
            "kind": "model" if value else "observation",
            "start": a,
            "end": b,
            "text": tok.decode(ids[a:b], skip_special_tokens=False),
        }
        for value, a, b in mask_runs(mask)
    ]
    # The k-th turn that appended tokens owns the k-th observation span.
    observations = iter([s["text"] for s in spans if s["kind"] == "observation"])
    turns = [
        {
            "index": t.index,
            "action": t.action,
            "query": t.query,
            "doc_ids": list(t.doc_ids),
            "observation": next(observations, "") if t.observation_tokens else "",
            "tool_latency_s": t.tool_latency_s,
            "tool_attempts": t.tool_attempts,
            "error": t.error,
            "generated_tokens": t.generated_tokens,
            "observation_tokens": t.observation_tokens,
            "generate_latency_s": t.generate_latency_s,
            "engine_finish_reason": t.engine_finish_reason,
            "weight_version": t.weight_version,
            "cached_tokens": t.cached_tokens,
            "reward": t.reward,
            "tool_calls": [
                {
                    "name": c.name,
                    "arguments_json": c.arguments_json,
                    "result": c.result,
                    "error": c.error,
                    "latency_s": c.latency_s,
                    "attempts": c.attempts,
                }
                for c in t.tool_calls
            ],
        }
        for t in traj.turns
    ]
    finish = FinishReason.Name(traj.finish_reason).removeprefix("FINISH_REASON_").lower()
    return {
        Col.KIND: kind,
        Col.STEP: traj.rollout_step,
        Col.EVAL_ID: eval_id,
        Col.LOGGED_REASON: reason,
        Col.TRAJECTORY_ID: traj.trajectory_id,
        Col.GROUP_ID: traj.group_id,
        Col.SAMPLE_INDEX: traj.sample_index,
        Col.GROUP_SIZE: traj.group_size,
        Col.PROMPT_ID: traj.prompt_id,
        Col.DATA_SOURCE: traj.data_source,
        Col.QUESTION: question_of(prompt_text),
        Col.PROMPT_TOKEN_IDS: list(traj.prompt_token_ids),
        Col.PROMPT_TEXT: prompt_text,
        Col.RESPONSE_TOKEN_IDS: ids,
        Col.TOKEN_TEXTS: token_texts,
        Col.RESPONSE_TEXT: response_text,
        Col.LOSS_MASK: mask,
        Col.ROLLOUT_LOGPROBS: list(traj.rollout_logprobs),
        Col.HAS_ROLLOUT_LOGPROBS: traj.has_rollout_logprobs,
        Col.TIS_WEIGHTS: list(tis_weights) if tis_weights is not None else None,
        Col.SPANS: spans,
        Col.TURNS: turns,
        Col.NUM_SEARCHES: sum(count_searches(t) for t in traj.turns),
        Col.NUM_INVALID: sum(t.action == "invalid" for t in traj.turns),
        Col.NUM_TOOL_ERRORS: sum(bool(t.error) for t in traj.turns),
        Col.RESPONSE_LEN: len(ids),
        Col.REWARD: traj.reward.total,
        Col.REWARD_COMPONENTS: dict(traj.reward.components),
        Col.EXTRACTED_ANSWER: extract_answer(response_text),
        Col.GOLD_ANSWERS: list(traj.gold_answers),
        Col.FINISH_REASON: finish,
        Col.ERROR: traj.error,
        Col.INFRASTRUCTURE_FAILURE: traj.infrastructure_failure,
        Col.WEIGHT_VERSION: traj.weight_version,
        Col.MAX_WEIGHT_VERSION: traj.max_weight_version,
        Col.TEMPERATURE: traj.temperature,
        Col.CREATED_AT: traj.timings.created_at,
        Col.FINISHED_AT: traj.timings.finished_at,
    }


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """Write atomically (a reader never sees half a file): to a temporary name, then rename."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        table = pa.Table.from_pylist(rows, schema=rollout_schema())
        pq.write_table(table, tmp, compression="zstd")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # half a file must not keep taking the room it took
        raise


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def _reason(s: Sample) -> str | None:
    """Why a sample outside the logged groups is still worth logging, if it is."""
    status = s.status.value if s.status else "error"
    if status in _FAILED or s.infrastructure_failure:
        return "failed"
    if any(t.action == "invalid" for t in s.turns):
        return "invalid"
    if status in _TRUNCATED:
        return "truncated"
    if any(t.error for t in s.turns):
        return "failed"
    return None


def select(samples: list[Sample], groups: int, failures: int) -> list[tuple[Sample, str]]:
    """The first `groups` whole groups (the sampler's order), then up to `failures` others
    that failed, were truncated or took an invalid action."""
    chosen: list[tuple[Sample, str]] = []
    group_ids = list(dict.fromkeys(s.group_id for s in samples))[:groups]
    keep = set(group_ids)
    chosen += [(s, "group") for s in samples if s.group_id in keep]
    extra = [(s, r) for s in samples if s.group_id not in keep and (r := _reason(s))]
    return chosen + extra[:failures]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:60] or "eval"


class RolloutLog:
    """Writes the rollout log of one run; the orchestrator calls `log_step` and `log_eval`."""

    def __init__(self, cfg: RolloutLogConfig, tokenizer: Decoder) -> None:
        if not cfg.run_dir:
            raise ValueError("rollout_log.run_dir is not set")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.layout = RunLayout(Path(cfg.run_dir))
        self.root = self.layout.rollouts
        self._failing = False  # the last write failed (logged once per spell)

    # -- the async entry points: never raise, never block the event loop ----------------------

    async def log_step(
        self,
        step: int,
        samples: list[Sample],
        summary: dict[str, float] | None = None,
        outcomes: dict[str, str] | None = None,
    ) -> None:
        try:
            await asyncio.to_thread(self.write_step, step, samples, summary or {}, outcomes)
        except Exception:  # the log is a diagnostic: a full disk must not stop training
            self._failed("writing step", {"step": step})
        else:
            self._written()

    async def log_eval(
        self, samples: list[Sample], result: dict[str, Any], *, label: str, step: int = -1
    ) -> str | None:
        if not self.cfg.evaluations:
            return None
        try:
            eval_id = await asyncio.to_thread(self.write_eval, samples, result, label, step)
        except Exception:
            self._failed("writing evaluation", {"label": label})
            return None
        self._written()
        return eval_id

    def _failed(self, what: str, context: dict[str, Any]) -> None:
        ROLLOUT_LOG_FAILURES.inc()
        if not self._failing:  # once per spell: a full disk fails every step until freed
            log.exception(f"rollout log: {what} failed; not logged until a write works again",
                          extra=context)  # fmt: skip
        self._failing = True

    def _written(self) -> None:
        if self._failing:
            log.info("rollout log: written again after failures")
        self._failing = False

    # -- the writers --------------------------------------------------------------------------

    def _rows(self, chosen: list[tuple[Sample, str]], kind: str, eval_id: str = "") -> list[dict]:
        rows = []
        for s, reason in chosen:
            try:
                traj = to_trajectory(s)
            except ValueError as e:  # a malformed failed sample: say so, keep the others
                log.warning("rollout log: sample skipped", extra={"error": str(e)})
                continue
            rows.append(
                trajectory_row(traj, self.tokenizer, kind=kind, reason=reason, eval_id=eval_id)
            )
        return rows

    def write_step(
        self,
        step: int,
        samples: list[Sample],
        summary: dict[str, float],
        outcomes: dict[str, str] | None = None,
    ) -> Path:
        """`outcomes`: group id -> what became of it (published, filtered, surplus, ...)."""
        failures = self.cfg.max_failures_per_step if self.cfg.log_failures else 0
        chosen = select(samples, self.cfg.groups_per_step, failures)
        path = self.layout.step_file(step)
        write_rows(self._rows(chosen, TRAIN), path)
        logged = {s.trajectory_id for s, _ in chosen}
        groups: dict[str, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        versions = [v for s in samples for v in s.weight_versions]
        record = {
            "step": step,
            "ts": round(time.time(), 3),
            "file": str(path.relative_to(self.root)),
            "summary": summary,
            # Newest minus oldest policy version among this step's turns.
            "staleness_max": (max(versions) - min(versions)) if versions else 0,
            "groups": [
                {
                    "group_id": gid,
                    "prompt_id": g[0].prompt.prompt_id,
                    "data_source": g[0].prompt.data_source,
                    "rewards": [s.reward for s in g],
                    "finish": [s.status.value if s.status else "" for s in g],
                    "searches": [sum(t.searches for t in s.turns) for s in g],
                    "logged": [s.sample_index for s in g if s.trajectory_id in logged],
                    "outcome": (outcomes or {}).get(gid, "published"),
                }
                for gid, g in groups.items()
            ],
        }
        _append_jsonl(self.layout.steps, record)
        self.rotate()
        return path

    def write_eval(
        self, samples: list[Sample], result: dict[str, Any], label: str, step: int = -1
    ) -> str:
        eval_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{_slug(label)}"
        for n in itertools.count(2):  # two evaluations within a second keep apart
            if not self.layout.eval_file(eval_id).exists():
                break
            eval_id = f"{eval_id.rsplit('~', 1)[0]}~{n}"
        rows = self._rows([(s, EVAL) for s in samples], EVAL, eval_id)
        for row in rows:
            row[Col.STEP] = step
        write_rows(rows, self.layout.eval_file(eval_id))
        versions = [v for s in samples for v in s.weight_versions]
        record = {
            "eval_id": eval_id,
            "label": label,
            "step": step,
            "ts": round(time.time(), 3),
            "weight_version": max(versions) if versions else None,
            **{k: result.get(k) for k in ("overall", "macro", "per_source", "seconds")},
        }
        _append_jsonl(self.layout.evals, record)
        return eval_id

    def rotate(self) -> None:
        """Delete the oldest step files while train/ is over `max_bytes` (the newest stays)."""
        files = sorted((self.root / TRAIN).glob(STEP_FILES))
        total = sum(f.stat().st_size for f in files)
        for f in files[:-1]:
            if total <= self.cfg.max_bytes:
                break
            total -= f.stat().st_size
            f.unlink(missing_ok=True)
