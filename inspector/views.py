"""What each page shows, computed from a `RunDir`: plain data for the templates (no HTTP)."""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup, escape

from inspector.rundir import RunDir

# (panel title, metric keys): trainer keys as trainer/*.py write them; `rollout/*` are the
# orchestrator's step summaries from the rollout log. A panel is shown when any key has data.
PANELS: list[tuple[str, list[str]]] = [
    ("Reward / EM", ["reward/mean", "reward/em", "rollout/reward_mean", "rollout/em_mean"]),
    ("KL", ["kl"]),
    ("Entropy", ["entropy"]),
    ("Clip fractions", ["clip_fraction_low", "clip_fraction_high", "tis/clip_fraction"]),
    ("Grad norm", ["grad_norm"]),
    ("Response length", ["response_length/mean", "response_length/max"]),
    ("Searches per sample", ["rollout/searches_mean", "rollout/turns_mean"]),
    ("Observation fraction", ["loss_mask/observation_fraction", "rollout/observation_fraction"]),
    ("TIS effective sample size", ["tis/effective_sample_size"]),
    ("Staleness (versions)", ["rollout/staleness_max"]),
    ("Throughput", ["throughput/tokens_per_s", "rollout/samples_per_s"]),
    ("Loss", ["loss"]),
]
FAILED = ("error", "aborted")


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(f"{v:.6g}")  # six significant digits keep the JSON small


def curves(run: RunDir) -> dict[str, Any]:
    """uPlot-ready panels: `data` = [steps, series...] with null where a step lacks a value.

    Rollout step s is drawn at training step s + 1, the step that trains on it (sync mode)."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in run.train_metrics():
        if isinstance(r.get("step"), int):
            by_step.setdefault(r["step"], {}).update(r)
    for r in run.rollout_steps():
        if isinstance(r.get("step"), int):
            values = {f"rollout/{k}": v for k, v in (r.get("summary") or {}).items()}
            values["rollout/staleness_max"] = r.get("staleness_max")
            by_step.setdefault(r["step"] + 1, {}).update(values)
    steps = sorted(by_step)
    panels = []
    for title, keys in PANELS:
        series = {k: [_num(by_step[s].get(k)) for s in steps] for k in keys}
        present = [k for k in keys if any(v is not None for v in series[k])]
        if present:
            panels.append(
                {"title": title, "labels": present, "data": [steps, *(series[k] for k in present)]}
            )
    evals = [e for e in run.evaluations() if isinstance(e.get("overall"), dict)]
    if evals:
        xs = [e.get("step", -1) if e.get("step", -1) >= 0 else i for i, e in enumerate(evals)]
        labels = [m for m in ("em", "sub_em", "f1") if any(m in e["overall"] for e in evals)]
        panels.append(
            {
                "title": "Held-out evaluations",
                "labels": labels,
                "data": [xs, *([_num(e["overall"].get(m)) for e in evals] for m in labels)],
            }
        )
    return {"panels": panels, "last_step": steps[-1] if steps else None}


def script_json(data: Any) -> Markup:
    """JSON safe inside a <script> element."""
    return Markup(json.dumps(data, separators=(",", ":")).replace("</", "<\\/"))


def _bucket(lp: float) -> int:
    """Logprob shading: 0 likely ... 3 unlikely."""
    return 0 if lp > -0.5 else 1 if lp > -1.5 else 2 if lp > -3 else 3


def token_html(row: dict[str, Any]) -> Markup:
    """The response as spans by loss mask: model spans token by token (hover shows each
    token's logprob), observation spans as one block of text."""
    texts, lps = row["token_texts"], row["rollout_logprobs"]
    shade = row["has_rollout_logprobs"]
    parts = []
    for span in row["spans"]:
        a, b = span["start"], span["end"]
        if span["kind"] == "observation":
            parts.append(
                f'<span class="span obs" data-a="{a}" data-b="{b}">{escape(span["text"])}</span>'
            )
            continue
        parts.append(f'<span class="span model" data-a="{a}" data-b="{b}">')
        for i in range(a, b):
            cls = f"t l{_bucket(lps[i])}" if shade and math.isfinite(lps[i]) else "t"
            parts.append(f'<span class="{cls}" data-i="{i}">{escape(texts[i])}</span>')
        parts.append("</span>")
    return Markup("".join(parts))


def passages(observation: str) -> list[str]:
    """The documents of one `<information>` block (`Doc i(Title: ...) text`), else the text."""
    body = observation.strip().removeprefix("<information>").removesuffix("</information>")
    docs = [d.strip() for d in re.split(r"(?=Doc \d+\(Title:)", body) if d.strip()]
    return docs or [body]


def arguments_text(arguments_json: str) -> str:
    """A call's arguments as one line of JSON (as the policy wrote them when not JSON)."""
    try:
        return json.dumps(json.loads(arguments_json), ensure_ascii=False)
    except (json.JSONDecodeError, TypeError):
        return arguments_json


def advantages(rewards: list[float]) -> list[float]:
    """GRPO's group-normalized advantage, (r - mean) / (std + 1e-6) with the unbiased std, as
    the trainer computes it by default (recomputed here: the trainer does not log it)."""
    if len(rewards) < 2:
        return [0.0 for _ in rewards]
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


def step_view(run: RunDir, step: int) -> dict[str, Any] | None:
    record = run.step_record(step)
    if record is None:
        return None
    logged = {(r["group_id"], r["sample_index"]): r["ref"] for r in run.trajectories(step=step)}
    groups = []
    for g in record.get("groups", []):
        rewards = g.get("rewards", [])
        groups.append(
            {
                **g,
                "advantages": advantages(rewards),
                "refs": [logged.get((g["group_id"], i)) for i in range(len(rewards))],
            }
        )
    trainer = next((m for m in run.train_metrics() if m.get("step") == step + 1), None)
    return {"record": record, "groups": groups, "trainer": trainer}


@dataclass(frozen=True)
class Filters:
    kind: str = ""
    step: int | None = None
    eval_id: str = ""
    finish: str = ""
    searches: str = ""  # "0" | "1" | "2" | "3+"
    errors: str = ""  # "yes" | "no" | "invalid"
    reason: str = ""
    min_reward: float | None = None
    max_reward: float | None = None
    q: str = ""


def _has_error(r: dict[str, Any]) -> bool:
    return bool(
        r["error"]
        or r["num_tool_errors"]
        or r["infrastructure_failure"]
        or r["finish_reason"] in FAILED
    )


def filter_rows(rows: list[dict[str, Any]], f: Filters) -> list[dict[str, Any]]:
    def keep(r: dict[str, Any]) -> bool:
        if f.finish and r["finish_reason"] != f.finish:
            return False
        if f.searches:
            n = r["num_searches"]
            if (f.searches == "3+" and n < 3) or (f.searches != "3+" and str(n) != f.searches):
                return False
        if f.errors == "yes" and not _has_error(r):
            return False
        if f.errors == "no" and _has_error(r):
            return False
        if f.errors == "invalid" and not r["num_invalid"]:
            return False
        if f.reason and r["logged_reason"] != f.reason:
            return False
        if f.min_reward is not None and r["reward"] < f.min_reward:
            return False
        return f.max_reward is None or r["reward"] <= f.max_reward

    return [r for r in rows if keep(r)]


def compare(run: RunDir, a: str, b: str) -> dict[str, Any]:
    """The same held-out questions in two evaluations, joined on prompt id; changed first."""
    rows_a = {r["prompt_id"]: r for r in run.eval_rows(a)}
    rows_b = {r["prompt_id"]: r for r in run.eval_rows(b)}
    pairs = []
    for pid in sorted(rows_a.keys() & rows_b.keys()):
        ra, rb = rows_a[pid], rows_b[pid]
        em_a = ra["reward_components"].get("em", 0.0)
        em_b = rb["reward_components"].get("em", 0.0)
        pairs.append(
            {"prompt_id": pid, "a": ra, "b": rb, "em_a": em_a, "em_b": em_b, "delta": em_b - em_a}
        )
    pairs.sort(key=lambda p: (-abs(p["delta"]), -p["delta"], p["prompt_id"]))
    n = len(pairs) or 1
    return {
        "pairs": pairs,
        "em_a": sum(p["em_a"] for p in pairs) / n,
        "em_b": sum(p["em_b"] for p in pairs) / n,
        "improved": sum(p["delta"] > 0 for p in pairs),
        "regressed": sum(p["delta"] < 0 for p in pairs),
        "only_a": len(rows_a.keys() - rows_b.keys()),
        "only_b": len(rows_b.keys() - rows_a.keys()),
    }
