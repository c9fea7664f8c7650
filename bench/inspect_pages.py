"""Inspector page render times in headless Chromium (the browser's own performance timing).

    python bench/inspect_pages.py [--tokens 8000] [--searches 4] [--steps 1000] [--repeats 5]

Builds a run directory through the real writers: one trajectory of about `--tokens` response
tokens with `--searches` searches (the trajectory page), and a `--steps`-step run (trainer
metrics with every step's trajectory ids, as the trainer writes them, plus the rollout log's
step summaries: the overview and its curves). Serves it with uvicorn, loads each page in
Debian's Chromium through Playwright, and reads `loadEventEnd` of the navigation entry: request,
server rendering, parsing, scripts and chart drawing up to the load event. The first load
(cold: nothing cached by the server) is reported apart from the median of the next loads.
The last line is key=value pairs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The repo root instead of bench/ (a bench/<name>.py must not shadow a module or package).
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from harness.chromium import ARGS, CHROMIUM  # noqa: E402
from harness.inspector_run import (  # noqa: E402
    ServerThread,
    WordTokenizer,
    long_trajectory_run,
    make_group,
    synthetic_metrics,
)
from inspector.server import create_app  # noqa: E402


def build(root: Path, tokens: int, searches: int, steps: int) -> tuple[Path, Path, str]:
    from orchestrator.config import RolloutLogConfig
    from orchestrator.rollout_log import RolloutLog

    traj_run, long_run = root / "trajectory", root / "long"
    tid = long_trajectory_run(traj_run, tokens, searches)
    synthetic_metrics(long_run, steps)
    # As the trainer writes them: every line lists the step's trajectory ids (32 x 8 here).
    lines = (long_run / "train_metrics.jsonl").read_text().splitlines()
    with (long_run / "train_metrics.jsonl").open("w") as f:
        for line in lines:
            r = json.loads(line)
            r["trajectory_ids"] = [
                f"run/{r['step']}/nq/train/{g}/{k}" for g in range(32) for k in range(8)
            ]
            f.write(json.dumps(r) + "\n")
    tok, rng = WordTokenizer(), random.Random(0)
    log = RolloutLog(RolloutLogConfig(run_dir=str(long_run)), tok)
    samples = make_group(tok, rng, 0, 0, 8, "run")
    for step in range(steps):
        for s in samples:
            s.rollout_step = step
        log.write_step(
            step,
            samples,
            {
                "reward_mean": rng.random(),
                "searches_mean": 1.5,
                "observation_fraction": 0.4,
                "samples_per_s": 5.0,
            },
        )
    return traj_run, long_run, tid


def load_ms(page, url: str) -> float:  # type: ignore[no-untyped-def]
    page.goto(url, wait_until="load")
    return page.evaluate(
        "() => { const n = performance.getEntriesByType('navigation')[0];"
        " return n.loadEventEnd - n.startTime; }"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--searches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        traj_run, long_run, tid = build(Path(tmp), args.tokens, args.searches, args.steps)
        print(f"built the runs in {time.perf_counter() - t0:.1f} s")
        results: dict[str, tuple[float, float]] = {}
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for name, run, path, check in (
                ("trajectory", traj_run, f"/t/train/step-000000/{tid}", "#response .t"),
                ("overview", long_run, "/", ".chart canvas"),
            ):
                with ServerThread(create_app(run)) as server:
                    times = [load_ms(page, server.url + path) for _ in range(1 + args.repeats)]
                    count = page.locator(check).count()
                    page.goto("about:blank")
                results[name] = (times[0], statistics.median(times[1:]))
                print(
                    f"{name:<10}: cold {times[0]:7.1f} ms, median of {args.repeats} "
                    f"{results[name][1]:7.1f} ms ({count} x {check})"
                )
            browser.close()
    print(
        f"trajectory_ms={results['trajectory'][1]:.1f} overview_ms={results['overview'][1]:.1f} "
        f"trajectory_cold_ms={results['trajectory'][0]:.1f} "
        f"overview_cold_ms={results['overview'][0]:.1f} tokens={args.tokens} "
        f"searches={args.searches} steps={args.steps}"
    )


if __name__ == "__main__":
    main()
