"""The demo (`searchr1 demo`) as the one-shot containers of the compose `cpu` profile.

The services are the stack's own containers; these two commands do what `run_demo` does
around them, with its functions:

    python -m demos.containers setup   # demo-setup: world, rows, index, warm start
    python -m demos.containers report  # demo-report: held-out eval after GRPO,
                                                     # the demo's table and key=value line

In between, `searchr1 eval` (demo-eval-before) evaluates the warm start through the retriever and
engine containers, and the orchestrator and trainer containers run GRPO. Paths are the volumes'
mount points in docker-compose.yml; the stack config is the mounted one (SEARCHR1_CONFIG).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import time
from pathlib import Path

from demos.cli import print_demo_summary
from demos.run import DemoConfig, build_policy, plot, summarize, summary_row, write_rows
from demos.warmstart import WarmStartConfig
from demos.world import generate_world, write_world
from orchestrator.config import OrchestratorSettings
from orchestrator.data import load_prompts
from orchestrator.wiring import evaluate_served
from retriever.build import build_index
from retriever.config import BuildConfig
from searchr1.logs import setup_logging
from searchr1.settings import load_settings
from trainer.config import TrainerSettings

log = logging.getLogger("searchr1.demo.containers")

STARTED = "started.json"  # in the runs volume: when setup began (the demo's wall_s counts from it)


def _settings() -> OrchestratorSettings:
    return load_settings(OrchestratorSettings, os.environ.get("SEARCHR1_CONFIG"))


def _trainer_backend() -> str:
    return load_settings(TrainerSettings, os.environ.get("SEARCHR1_CONFIG")).trainer.backend


def setup(runs: Path, data: Path, index: Path, model: Path, seed: int) -> None:
    """World, train/test rows, MiniLM index and the warm-started policy, into the volumes."""
    (runs / STARTED).write_text(json.dumps({"time": time.time(), "seed": seed}) + "\n")
    # Demonstrations show as many documents per search as the rollouts will get.
    topk = _settings().orchestrator.search.topk
    cfg = DemoConfig(out_dir=runs, seed=seed, warm_start=WarmStartConfig(seed=seed, topk=topk))
    world = generate_world(cfg.seed, n_people=cfg.n_people)
    files = write_world(world, runs / "world")
    write_rows(world, data)
    # MiniLM was trained without e5's "query: "/"passage: " prefixes (as in run_demo).
    build_index(files["corpus"], index, BuildConfig(query_prefix="", passage_prefix=""))
    warm = build_policy(cfg, world)
    shutil.copytree(warm, model, dirs_exist_ok=True)
    log.info("demo setup done: rows %s, index %s, warm-started model %s", data, index, model)


def report(runs: Path, test_rows: Path) -> dict[str, float]:
    """Evaluate the engine (holding the trainer's last push) on the held-out rows; print the
    demo's table and last line. Fails unless the engine serves the final step's weights."""
    cfg = _settings()
    prompts = load_prompts(test_rows)
    after = asyncio.run(
        evaluate_served(cfg.orchestrator, cfg.engines, cfg.bus, prompts, run_id=cfg.run.id)
    )
    version = str(after.get("weight_version"))
    if cfg.run.max_steps is not None and version != str(cfg.run.max_steps):
        raise SystemExit(
            f"demo-report: the engine serves weight_version {version}, not the last trained "
            f"step {cfg.run.max_steps}: the trainer's final push did not arrive"
        )
    (runs / "eval_after.json").write_text(json.dumps(after, indent=2) + "\n")
    before = json.loads((runs / "eval_before.json").read_text())
    b, a = summary_row(before), summary_row(after)
    plot(runs / "train_metrics.jsonl", b["em"], a["em"], runs / "demo.png")
    started = json.loads((runs / STARTED).read_text())["time"]
    result = summarize(b, a, time.time() - started)
    # the cpu profile's engine; the trainer's backend as its config names it
    print_demo_summary(result, runs, "torch", _trainer_backend())
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("setup", help="world, rows, index and warm start into the volumes")
    s.add_argument("--runs", type=Path, default=Path("/runs"))
    s.add_argument("--data", type=Path, default=Path("/data"))
    s.add_argument("--index", type=Path, default=Path("/index"))
    s.add_argument("--model", type=Path, default=Path("/models/warm"))
    s.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("report", help="held-out eval after GRPO, the table and key=value line")
    r.add_argument("--runs", type=Path, default=Path("/runs"))
    r.add_argument("--data", type=Path, default=Path("/data/test.jsonl"))
    args = p.parse_args(argv)
    setup_logging("demo", "INFO", json_format=False)  # as `searchr1 demo`: phases, steps, losses
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per evaluation request
    if args.command == "setup":
        setup(args.runs, args.data, args.index, args.model, args.seed)
    else:
        report(args.runs, args.data)


if __name__ == "__main__":
    main()
