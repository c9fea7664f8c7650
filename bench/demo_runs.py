"""Compare finished demo runs: GRPO step time, rollout time, prefix-cache hits, held-out EM.

    python -m bench.demo_runs runs/demo-cache-off runs/demo-cache-on [...]

Per run directory (what `searchr1 demo --out DIR` leaves): the trainer's step time and the part
of it spent waiting for rollouts (`train_metrics.jsonl`: time/step_s, time/wait_data_s; sync
mode, so the wait is the rollout of the step), and the share of the cacheable prefix that the
engine served from its cache, by turn, over the logged trajectories of the rollout log (turn 1:
the prompt; later turns: the previous call's input and output), and EM before/after RL. The
first run is the baseline of the ratios. The last line is key=value pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from demos.run import summary_row


def step_times(run: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run / "train_metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step_s" in r][1:]  # the first step also warms up
    step = [r["time/step_s"] for r in rows]
    wait = [r.get("time/wait_data_s", 0.0) for r in rows]
    return {
        "steps": len(rows) + 1,
        "step_s_median": statistics.median(step),
        "step_s_mean": statistics.fmean(step),
        "rollout_s_median": statistics.median(wait),
        "grpo_s": sum(step),
    }


def hit_rates(run: Path) -> dict[str, float]:
    cacheable = {"first": 0, "later": 0}
    cached = {"first": 0, "later": 0}
    for path in sorted((run / "rollouts" / "train").glob("step-*.parquet")):
        table = pq.read_table(path, columns=["prompt_token_ids", "turns"]).to_pylist()
        for row in table:
            context = reusable = len(row["prompt_token_ids"])
            for k, turn in enumerate(row["turns"]):
                kind = "first" if k == 0 else "later"
                cacheable[kind] += reusable
                cached[kind] += min(int(turn.get("cached_tokens") or 0), reusable)
                context += turn["generated_tokens"]
                reusable = context  # the next call can reuse this one's input and output
                context += turn["observation_tokens"]
    return {f"hit_{k}": cached[k] / cacheable[k] if cacheable[k] else 0.0 for k in cacheable}


def em(run: Path) -> dict[str, float]:
    before = summary_row(json.loads((run / "eval_before.json").read_text()))
    after = summary_row(json.loads((run / "eval_after.json").read_text()))
    return {"em_before": before["em"], "em_after": after["em"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    runs = ap.parse_args().runs
    results: list[dict[str, Any]] = []
    for run in runs:
        r = {"run": run.name, **step_times(run), **hit_rates(run), **em(run)}
        results.append(r)
        print(
            "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
        )
    base = results[0]
    line: dict[str, Any] = {}
    for r in results:
        tag = r["run"].replace("-", "_")
        line[f"{tag}_step_s"] = round(r["step_s_median"], 3)
        line[f"{tag}_rollout_s"] = round(r["rollout_s_median"], 3)
        line[f"{tag}_hit_later"] = round(r["hit_later"], 3)
        line[f"{tag}_em_after"] = round(r["em_after"], 3)
        if r is not base:
            line[f"{tag}_step_ratio"] = round(r["step_s_median"] / base["step_s_median"], 3)
    print(" ".join(f"{k}={v}" for k, v in line.items()))


if __name__ == "__main__":
    main()
