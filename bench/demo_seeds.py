"""Learning across training seeds: the demo recipe over several `--train-seed` values, with and
without dynamic sampling, on one world and one warm start.

    python -m bench.demo_seeds [--seeds 1,2,3,4,5] [--modes plain,dynamic] [--out runs/seeds]
    python -m bench.demo_seeds --quick --seeds 1 --modes plain      # smallest: one quick demo
    python -m bench.demo_seeds --task guess-number --modes plain    # another task's demo
    python -m bench.demo_seeds --warm-start-from runs/demo    # a finished demo's warm start
    python -m bench.demo_seeds --task guess-number --modes plain --sampled 8  # + sampled success

Each run is `searchr1 demo --train-seed S [--dynamic-sampling] --warm-start-from <first run>`
(the warm start is deterministic per world seed, so it is computed once, or taken from
`--warm-start-from`: a finished demo of the same task and world seed), one at a time. A run
whose `eval_after.json` exists is not run again: the sweep can be stopped and resumed. Prints
held-out EM per seed and mode, the minimum and mean per mode, the share of seeds at EM >= 0.9
(issue 27's bar), and the gain over the warm start (its minimum, and the share of seeds that
gained >= 0.15: issue 42's bar). `--sampled N` (a task with an environment) also plays each eval
game N times at the demo's training temperature with the warm and the trained model, in this
process: the sampled success besides the greedy one. The last line is key=value pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from demos.run import summary_row

GOAL_EM = 0.9
GOAL_GAIN = 0.15


def run(
    out: Path,
    seed: int,
    dynamic: bool,
    warm_from: Path | None,
    quick: bool = False,
    task: str = "search-r1",
    sampled: int = 0,
) -> dict[str, float]:
    if not (out / "eval_after.json").exists():
        cmd = [
            sys.executable,
            "-m",
            "stack.cli",
            "demo",
            "--out",
            str(out),
            "--train-seed",
            str(seed),
            "--task",
            task,
        ]
        if dynamic:
            cmd.append("--dynamic-sampling")
        if quick:
            cmd.append("--quick")
        if warm_from is not None:
            cmd += ["--warm-start-from", str(warm_from)]
        start = time.monotonic()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        print(f"  {out.name}: {time.monotonic() - start:.0f} s", flush=True)
    metrics = [json.loads(x) for x in (out / "train_metrics.jsonl").read_text().splitlines()]
    after = summary_row(json.loads((out / "eval_after.json").read_text()))
    before = summary_row(json.loads((out / "eval_before.json").read_text()))
    result = {"em": after["em"], "gain": after["em"] - before["em"], "train_steps": len(metrics)}
    if sampled:
        from demos.task import sampled_success

        warm = (warm_from or out) / "model-warm"
        result["sampled_before"] = sampled_success(task, 0, warm, sampled)
        result["sampled_after"] = sampled_success(task, 0, out / "model-trained", sampled)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--modes", default="plain,dynamic")
    ap.add_argument("--out", type=Path, default=Path("runs/seeds"))
    ap.add_argument("--task", default="search-r1", help="the demo's task (searchr1 demo --task)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the quick demo's world, warm start and 2 steps per run (a smoke run, minutes)",
    )
    ap.add_argument(
        "--warm-start-from",
        type=Path,
        default=None,
        help="a finished demo's out dir (same task, world seed 0): its warm start for every run",
    )
    ap.add_argument(
        "--sampled",
        type=int,
        default=0,
        help="also play each eval game N times sampled (a task with an environment): 0 = off",
    )
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"plain", "dynamic"}:
        ap.error("--modes: plain and/or dynamic")
    warm_from: Path | None = args.warm_start_from
    em: dict[str, dict[int, float]] = {m: {} for m in modes}
    gain: dict[str, dict[int, float]] = {m: {} for m in modes}
    sampled_gain: dict[str, dict[int, float]] = {m: {} for m in modes}
    for seed in seeds:  # seeds outermost: a stopped sweep still has both modes per seed
        for mode in modes:
            out = (args.out / f"{mode}-seed{seed}").resolve()
            result = run(
                out, seed, mode == "dynamic", warm_from, args.quick, args.task, args.sampled
            )
            warm_from = warm_from or out
            em[mode][seed], gain[mode][seed] = result["em"], result["gain"]
            if args.sampled:
                sampled_gain[mode][seed] = result["sampled_after"] - result["sampled_before"]
            sampled = "".join(
                f" {k}={result[k]:.3f}" for k in ("sampled_before", "sampled_after") if k in result
            )
            print(
                f"seed={seed} mode={mode} em_after={result['em']:.3f} gain={result['gain']:.3f}"
                + sampled,
                flush=True,
            )
    line: dict[str, float | str] = {"task": args.task}
    for mode, by_seed in em.items():
        values = list(by_seed.values())
        line[f"{mode}_em_min"] = round(min(values), 3)
        line[f"{mode}_em_mean"] = round(statistics.fmean(values), 3)
        line[f"{mode}_at_goal"] = round(sum(v >= GOAL_EM for v in values) / len(values), 3)
        gains = list(gain[mode].values())
        line[f"{mode}_gain_min"] = round(min(gains), 3)
        line[f"{mode}_gain_mean"] = round(statistics.fmean(gains), 3)
        line[f"{mode}_learned"] = round(sum(g >= GOAL_GAIN for g in gains) / len(gains), 3)
        if sampled_gain[mode]:
            mean = statistics.fmean(sampled_gain[mode].values())
            line[f"{mode}_sampled_gain_mean"] = round(mean, 3)
    print(" ".join(f"{k}={v}" for k, v in line.items()))


if __name__ == "__main__":
    main()
