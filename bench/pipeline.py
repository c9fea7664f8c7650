"""The whole RL loop at cluster shapes: where a step's time goes, sync against async.

Real `searchr1 orchestrator run` process(es), the real bus (Redis, streams of this run's own)
and the real trainer (`searchr1 trainer run`: `TrainingLoop`, the GRPO core, the weight push
protocol) against simulated hardware that is separate as on a cluster (`harness.sim`): engines
on their own GPUs (`harness.sim.engine`: continuous batching, prefill, KV and batch limits, a
prefix cache per engine whose hits follow `--routing`, the pause of a push), a retriever with
our measured latency curve (`harness.sim.retriever`), and a trainer backend that sleeps for its
tokens at the measured H100 rate (`harness.sim.trainer`). The cost model and its sources:
`harness/sim/cost.py` and docs/scale.md ("The pipeline bench").

`--shape areal` is AReaL's published setting (arXiv 2505.24298 and inclusionAI/AReaL; every
number's source in `AREAL` below and docs/benchmarks.md), at 1/16 of its 128 GPUs with the
same load per GPU: colocated sync and async (staleness 4) alternate `--repeats` times, and the
last line holds their ratio beside AReaL's 2.77.

Time is scaled: the simulated hardware runs `--time-scale` simulated seconds per real second,
and every time reported is simulated (real seconds x scale). What is not simulated (the
orchestrator's and the trainer's own CPU, HTTP and Redis round trips) is inflated by the same
factor, so the scale is kept low enough that those stay a few percent of a step (printed).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline --quick
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline --shape original8
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m bench.pipeline --shape areal
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
import yaml

from bench.pipeline_model import (
    AREAL,
    AREAL_RATIO,
    ModeResult,
    Shape,
    bounds,
    expected_sample,
    least_ideal_s,
    plan_split,
    rollout_steps,
    summarize,
)
from harness.child_process import wait_http
from harness.sim.cost import EngineCost
from harness.sim.engine import ROUTINGS


def free_ports(low: int = 39100, high: int = 39500) -> Iterator[int]:
    """Ports of this bench's share of the machine's (39100-39499) that nothing listens on,
    from a random start: two benches at once do not collide."""
    start = random.randrange(low, high)
    for port in [*range(start, high), *range(low, start)]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        yield port
    raise RuntimeError(f"no free port in {low}-{high - 1}")


PORTS = free_ports()
SHAPES = {
    # slime's examples/search-r1: 32 prompts x 8, max 2 generation calls of 512 tokens, 8 GPUs.
    "slime8": Shape("slime8", 32, 8, gpus=8, semantics="slime", max_turns=2, turn_tokens=512,
                    response_tokens=4096, obs_tokens=None, time_scale=2.0),
    # The original Search-R1: 512 x 5, 4 search rounds + answer, 500 tokens per turn and per
    # observation, 8 GPUs.
    "original8": Shape("original8", 512, 5, gpus=8, semantics="original", max_turns=4,
                       turn_tokens=500, response_tokens=4096, obs_tokens=500, time_scale=2.0),
    # slime's recipe at 64 GPUs, the batch grown with the GPUs (256 x 8: docs/scale.md's rule).
    "slime64": Shape("slime64", 256, 8, gpus=64, semantics="slime", max_turns=2,
                     turn_tokens=512, response_tokens=4096, obs_tokens=None, time_scale=1.0),
    # For the test that keeps this bench running: a few samples on 2 GPUs.
    "tiny": Shape("tiny", 4, 2, gpus=2, semantics="slime", max_turns=2, turn_tokens=512,
                  response_tokens=4096, obs_tokens=None, time_scale=2.0),
    "areal": AREAL,
}  # fmt: skip
MODES = {
    "sync": ("sync", 0),
    "async1": ("async", 1),
    "async2": ("async", 2),
    "async4": ("async", 4),
    # sync with every GPU rolling out and then training (not what this stack deploys: the
    # baseline of AReaL's and ROLL's speedups). Its engine-to-trainer hand-over (offloading
    # and reloading weights and KV) is not modelled: a lower bound on its step.
    "colocated": ("sync", 0),
}
DEFAULT_MODES = ["sync", "async1", "async2", "async4"]


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), **(env or {})}
    with log.open("ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def write_inputs(tmp: Path, rows: int) -> tuple[Path, Path, int, int]:
    """The tiny model (its tokenizer), training rows, and the prompt and observation lengths
    in its tokens."""
    from transformers import AutoTokenizer

    from harness.sim.retriever import DOC_TEXT
    from inference.tiny_model import make_tiny_model
    from orchestrator.observation import format_docs, observation_text
    from orchestrator.prompt import make_row, prompt_token_ids

    model = Path(make_tiny_model(tmp / "model"))
    path = tmp / "rows.jsonl"
    with path.open("w") as f:
        for i in range(rows):
            q = f"which river flows through city number {i} and who founded it"
            row = make_row(q, [f"answer {i}"], data_source="nq", split="train", index=i)
            f.write(json.dumps(row) + "\n")
    tok = AutoTokenizer.from_pretrained(model)
    messages = json.loads(path.read_text().splitlines()[0])["prompt"]
    prompt = prompt_token_ids(tok, messages)
    docs = [SimpleNamespace(id=str(i), contents=f'"Hamlet {i}"\n{DOC_TEXT}') for i in range(3)]
    obs = tok(observation_text(format_docs(docs)), add_special_tokens=False)["input_ids"]
    return model, path, len(prompt), len(obs)


def configs(
    shape: Shape, mode: str, args: argparse.Namespace, paths: dict[str, Path], urls: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    kind, staleness = MODES[mode]
    run_id = f"pipebench-{os.getpid()}-{shape.name}-{mode}{args.run_suffix}"
    per_step = shape.samples
    shared = {
        "redis": {"url": args.redis_url},
        "logging": {"level": "WARNING"},
        "run": {
            "id": run_id,
            "groups_per_step": shape.prompts,
            "group_size": shape.group_size,
            "max_steps": args.steps,
        },
        "bus": {"stream": f"searchr1:{run_id}", "max_backlog": per_step * (args.steps + 2)},
    }
    rollout: dict[str, Any] = {
        "turn_semantics": shape.semantics,
        "max_turns": shape.max_turns,
        "max_tokens_per_turn": shape.turn_tokens,
        "max_response_tokens": shape.response_tokens,
        "observation_max_tokens": shape.obs_tokens,
        # Every group of a step at once (the over-sampled ones included); overlapping async
        # steps take the places a step's finished groups free. (Room for all of the engines'
        # batch instead, 7,168 samples at slime64, measured slower: 10.3 s against 7.3 s at
        # staleness 2, the retriever and the engines' per-request speed overloaded.)
        "max_concurrent_samples": (shape.prompts + args.over_sampling)
        * shape.group_size
        // args.orchestrators,
    }
    if args.over_sampling:  # dynamic sampling's over-sampling (docs/orchestrator.md)
        rollout["over_sampling"] = args.over_sampling
    # The orchestrator rolls out past the trainer's last step, so the measured window is steady
    # (in async mode it would otherwise finish early and idle the engines at the end).
    orch_run = {**shared["run"], "max_steps": args.steps + staleness + 2}
    orch = {
        **shared,
        "logging": {"level": "INFO"},  # its "step done" records: the rollout step's time
        "run": orch_run,
        "engines": {"urls": [urls["engine"]]},
        "orchestrator": {
            "tokenizer_path": str(paths["model"]),
            "mode": kind,
            "max_staleness": staleness,
            "weight_poll_s": 0.02,
            "data": {"train_path": str(paths["rows"]), "seed": 0},
            "rollout": rollout,
            "search": {"retriever_url": urls["retriever"], "limits": {"max_concurrency": 256}},
            "partition": {"poll_s": 0.05},
        },
    }
    trainer = {
        **shared,
        "engines": {"urls": [urls["engine"]]},
        "trainer": {
            "backend": "harness.sim.trainer:load_sleeping_backend",
            "model": {"path": str(paths["model"]), "device": "cpu"},
            "http": {"port": next(PORTS)},
            "batch": {"consume_block_s": 0.05, "max_tokens_per_microbatch": 16384},
            "weight_push": {
                "mode": "distributed",
                "master_port": 0,  # a free one, taken at the first push
                "backend": "gloo",
                "resync_check_s": 3600,
            },
            "metrics_jsonl": str(paths["tmp"] / f"{run_id}.jsonl"),
        },
    }
    return orch, trainer


def run_mode(
    shape: Shape, mode: str, split: tuple[int, int], scale: float, args: argparse.Namespace,
    paths: dict[str, Path], urls: dict[str, str],
) -> ModeResult:  # fmt: skip
    """One mode's run: fresh trainer and orchestrator processes on a fresh run id."""
    tmp, py = paths["tmp"], sys.executable
    orch_cfg, trainer_cfg = configs(shape, mode, args, paths, urls)
    for kind in ("engine", "retriever"):
        httpx.post(f"{urls[kind]}/sim/reset", timeout=10).raise_for_status()
    name = f"{shape.name}-{mode}{args.run_suffix}"  # a repeat's files and run id are its own
    tcfg, ocfg = tmp / f"{name}-trainer.yaml", tmp / f"{name}-orch.yaml"
    tcfg.write_text(yaml.safe_dump(trainer_cfg))
    ocfg.write_text(yaml.safe_dump(orch_cfg))
    jsonl = Path(trainer_cfg["trainer"]["metrics_jsonl"])
    cost = json.dumps({"gpus": split[1], "time_scale": scale, "token_unit": shape.token_unit,
                       "tokens_per_s_per_gpu": shape.trainer_tok_s})  # fmt: skip
    log = tmp / f"{name}-trainer.log"
    procs = [
        start([py, "-m", "stack.cli", "trainer", "run", "--config", str(tcfg)], log,
              {"SEARCHR1_SIM_TRAINER": cost})
    ]  # fmt: skip
    for i in range(args.orchestrators):
        cmd = [py, "-m", "stack.cli", "orchestrator", "run", "--config", str(ocfg)]
        env = {"SEARCHR1_ORCHESTRATOR__PARTITION__WORKER_ID": f"orch-{i}"}
        cmd += ["--port", str(next(PORTS))]
        procs.append(start(cmd, tmp / f"{name}-orch-{i}.log", env))
    ps = [psutil.Process(p.pid) for p in procs]
    cpu: dict[int, float] = {}
    snaps: list[tuple[dict[str, Any], dict[str, Any], float, float]] = []
    deadline = time.monotonic() + args.timeout_s
    seen = 0
    try:
        while True:
            lines = jsonl.read_text().splitlines() if jsonl.exists() else []
            for line in lines[seen:]:
                if not line.endswith("}"):
                    break  # a line still being written
                stats = httpx.get(f"{urls['engine']}/sim/stats", timeout=10).json()
                snaps.append((json.loads(line), stats, cpu_seconds(ps, cpu), time.monotonic()))
                seen += 1
            if procs[0].poll() is not None and seen == len(lines):
                break
            for i, p in enumerate(procs[1:]):
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"{mode}: orchestrator {i} exited {p.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: not done after {args.timeout_s}s (logs: {tmp})")
            time.sleep(0.05)
        if procs[0].returncode != 0:
            raise RuntimeError(f"{mode}: trainer exited {procs[0].returncode}: {log}")
        retriever = httpx.get(f"{urls['retriever']}/sim/stats", timeout=10).json()
    finally:
        stop(procs)
        forget(args.redis_url, orch_cfg["run"]["id"])
    result = summarize(mode, snaps, args.warmup, split, scale, shape.token_unit)
    result.search_s = retriever["latency_s"] / max(retriever["served"], 1)
    lines = (tmp / f"{name}-orch-0.log").read_text().splitlines()
    for k, v in rollout_steps(lines, args.warmup, scale).items():
        setattr(result, k, v)
    return result


def forget(redis_url: str, run_id: str) -> None:
    """Delete this run's keys (its stream, the orchestrator's markers and claims)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"*{run_id}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    finally:
        client.close()


def cpu_seconds(ps: list[psutil.Process], seen: dict[int, float]) -> float:
    """CPU seconds of the processes (an exited one counts with its last reading)."""
    for p in ps:
        try:
            t = p.cpu_times()
            seen[p.pid] = t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return sum(seen.values())


def start_sims(
    shape: Shape, engines: int, scale: float, args: argparse.Namespace, paths: dict[str, Path]
) -> tuple[list[subprocess.Popen[bytes]], dict[str, str]]:
    tmp, py = paths["tmp"], sys.executable
    ports = {"engine": next(PORTS), "retriever": next(PORTS)}
    urls = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()}
    logs = {k: tmp / f"{shape.name}-{engines}-{k}.log" for k in ports}
    sims = [
        start([py, "-m", "harness.sim.engine", "--port", str(ports["engine"]), "--model",
               str(paths["model"]), "--engines", str(engines), "--time-scale", str(scale),
               "--cost", json.dumps(asdict(engine_cost(shape, args))),
               "--workload", json.dumps(asdict(shape.workload)), "--routing", args.routing],
              logs["engine"]),
        start([py, "-m", "harness.sim.retriever", "--port", str(ports["retriever"]),
               "--time-scale", str(scale), "--replicas", str(args.retriever_replicas)],
              logs["retriever"]),
    ]  # fmt: skip
    try:
        for kind, proc in zip(("engine", "retriever"), sims, strict=True):
            wait_http(f"{urls[kind]}/health", proc, logs[kind])
    except BaseException:
        stop(sims)
        raise
    return sims, urls


def engine_cost(shape: Shape, args: argparse.Namespace) -> EngineCost:
    if args.prefix_cache_tokens is None:
        return shape.engine
    return replace(shape.engine, prefix_cache_tokens=args.prefix_cache_tokens)


def run_shape(
    shape: Shape, args: argparse.Namespace, paths: dict[str, Path], prompt_tokens: int,
    obs_tokens: int,
) -> tuple[dict[str, ModeResult], float]:  # fmt: skip
    """Every mode of the run on `shape`, `args.repeats` times alternating (each mode's result:
    its repeats' mean step); also the least ideal bound over all splits."""
    work = expected_sample(shape, shape.workload, prompt_tokens, obs_tokens)
    cost = engine_cost(shape, args)
    # The split is planned at the hit rates measured with affinity routing (the default, as
    # our stack routes); other routings and no cache plan without hits. The engines' own
    # caches decide the hits measured.
    cached = cost.prefix_cache_tokens != 0 and args.routing == "affinity"
    hit = work.prefix_hit if cached else 0.0
    split = (
        (args.engines, shape.gpus - args.engines)
        if args.engines
        else plan_split(shape, work, cost, shape.trainer_tok_s, hit)
    )
    scale = args.time_scale or shape.time_scale
    floor = least_ideal_s(shape, work, cost, shape.trainer_tok_s, hit)
    print(
        f"\n== {shape.name}: {shape.prompts} x {shape.group_size} on {shape.gpus} GPUs: "
        f"{split[0]} engines + {split[1]} trainer GPUs; time x{scale:g}; routing "
        f"{args.routing}, planned prefix hit {hit:.2f}; expected per sample "
        f"{work.turns:.2f} turns, {work.generated:.0f} generated, {work.train:.0f} trained "
        f"tokens; least ideal step over all splits {floor:.2f} s"
    )
    runs: dict[str, list[ModeResult]] = {}
    sims: list[subprocess.Popen[bytes]] = []
    running: tuple[int, int] | None = None
    modes = args.modes or list(shape.modes or DEFAULT_MODES)
    try:
        for repeat in range(args.repeats):
            for mode in modes:
                # Colocated: every GPU rolls out, then every GPU trains (time-shared, as
                # slime's --colocate and the original's veRL): the sync baseline at equal GPUs.
                mode_split = (shape.gpus, shape.gpus) if mode == "colocated" else split
                if mode_split != running:
                    stop(sims)
                    sims, urls = start_sims(shape, mode_split[0], scale, args, paths)
                    running = mode_split
                t0 = time.monotonic()
                args.run_suffix = f"-r{repeat + 1}" if repeat else ""
                r = run_mode(shape, mode, mode_split, scale, args, paths, urls)
                r.bounds = bounds(r.generated, r.prefill, r.context, r.train_tokens,
                                  shape.samples, mode_split, cost, shape.trainer_tok_s)  # fmt: skip
                runs.setdefault(mode, []).append(r)
                print_mode(r, time.monotonic() - t0, f" (repeat {repeat + 1})" * (repeat > 0))
    finally:
        stop(sims)
    results = {
        m: replace(rs[0], step_s=statistics.fmean(r.step_s for r in rs)) for m, rs in runs.items()
    }
    if args.repeats > 1:
        for m, rs in runs.items():
            print(f"{m}: steps " + ", ".join(f"{r.step_s:.2f}" for r in rs) + " s")
    return results, floor


def print_mode(r: ModeResult, wall_s: float, note: str = "") -> None:
    b = r.bounds
    assert b is not None
    hist = " ".join(f"{k}:{v:.0f}" for k, v in r.staleness.items())
    print(
        f"{r.mode:7s} step {r.step_s:6.2f} s{note}  {r.samples_per_s:7.1f} samples/s  engines busy "
        f"{r.engine_busy:.2f} (at capacity {b.engine_s / r.step_s:.2f})  trainer busy "
        f"{r.trainer_busy:.2f} (modelled {b.trainer_s / r.step_s:.2f})  trainer waits "
        f"{r.wait_data_s:5.2f} s/step  push {r.push_s:.2f} s  staleness {{{hist}}}\n"
        f"        per step: {r.generated:,.0f} tokens generated, {r.discarded:,.0f} discarded, "
        f"{r.prefill:,.0f} prefilled, {r.train_tokens:,.0f} trained; mean context "
        f"{r.context:,.0f}; bounds: engines {b.engine_s:.2f} s, trainer+push {b.trainer_s:.2f} "
        f"s -> ideal {b.ideal_s:.2f} s, serial {b.serial_s:.2f} s; {r.steps} steps measured; "
        f"CPU {r.cpu_share:.2f} cores; {wall_s:.0f} s real\n"
        f"        rollout step (orchestrator, median) {r.rollout_step_s:.2f} s: "
        f"{r.turns_mean:.2f} turns, {r.searches_mean:.2f} searches per sample, "
        f"{r.truncation_rate:.3f} cut at a budget; search {r.search_s:.2f} s (mean); "
        f"prefix cache served {r.prefix_hit:.3f} of the context"
    )


def last_line(
    name: str, results: dict[str, ModeResult], least_ideal_s: float,
    reference: float | None = None,
) -> str:  # fmt: skip
    """`efficiency`: against the ideal bound of the split run; `efficiency_any_split`:
    against the best split's (the cluster's own limit); with a `reference` (AReaL's 2.77),
    `ratio` (colocated over async step) beside it as `areal_ratio`."""
    sync = results.get("sync")
    asyncs = [r for m, r in results.items() if m.startswith("async")]
    best = min(asyncs, key=lambda r: r.step_s) if asyncs else sync
    best = best or next(iter(results.values()))  # only colocated was run
    assert best.bounds is not None
    ideal = best.bounds.ideal_s
    speedup = sync.step_s / best.step_s if sync and asyncs else float("nan")
    # Sync's own bound: its measured rollout (long tail included), then train + push.
    sync_bound = (
        sync.rollout_step_s + sync.bounds.trainer_s
        if sync is not None and sync.bounds is not None
        else float("nan")
    )
    colocated = results.get("colocated")
    extra = (
        f" colocated_step_s={colocated.step_s:.2f} "
        f"speedup_vs_colocated={colocated.step_s / best.step_s:.2f}"
        if colocated is not None
        else ""
    )
    extra += f" prefix_hit={best.prefix_hit:.3f}"
    if reference is not None and colocated is not None:
        extra += f" ratio={colocated.step_s / best.step_s:.2f} areal_ratio={reference:.2f}"
    return (
        f"sync_step_s={sync.step_s if sync else float('nan'):.2f} "
        f"async_step_s={best.step_s:.2f} speedup={speedup:.2f} "
        f"engine_busy={best.engine_busy:.2f} trainer_busy={best.trainer_busy:.2f} "
        f"ideal_step_s={ideal:.2f} efficiency={ideal / best.step_s:.2f} "
        f"least_ideal_step_s={least_ideal_s:.2f} "
        f"efficiency_any_split={least_ideal_s / best.step_s:.2f} "
        f"sync_bound_s={sync_bound:.2f} "
        f"sync_vs_bound={(sync.step_s if sync else float('nan')) / sync_bound:.2f} "
        f"shape={name} async_mode={best.mode}{extra}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", nargs="+", choices=[*SHAPES, "all"], default=["slime8"])
    p.add_argument(
        "--modes", nargs="+", choices=list(MODES),
        help=f"default: the shape's (areal: colocated async4), else {' '.join(DEFAULT_MODES)}",
    )  # fmt: skip
    p.add_argument(
        "--repeats", type=int, default=None,
        help="times the modes alternate (default 1; areal: 2), each mode's step their mean",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=8, help="trainer steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the measurement")
    p.add_argument("--quick", action="store_true", help="slime8, 6 steps per mode (< 5 min)")
    p.add_argument("--time-scale", type=float, help="simulated s per real s (default: shape's)")
    p.add_argument(
        "--engines",
        type=int,
        help="engine GPUs (default: the least step with engines at ENGINE_LOAD)",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        help="each engine's prefix cache (default: the KV pool its running requests leave; "
        "0: no cache)",
    )
    p.add_argument(
        "--routing", choices=ROUTINGS, default="affinity",
        help="affinity: a sample's calls (its routing key) to one engine; least_loaded and "
        "round_robin ignore the key (so the caches hit less)",
    )  # fmt: skip
    p.add_argument("--retriever-replicas", type=int, default=1)
    p.add_argument("--orchestrators", type=int, default=1)
    p.add_argument(
        "--over-sampling",
        type=int,
        default=0,
        help="extra groups per step (orchestrator.rollout.over_sampling): a step ends with "
        "its last needed group, the rest stopped",
    )
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/0", help="the bus (this run's own streams)"
    )
    args = p.parse_args(argv)
    args.run_suffix = ""  # "-r2", ... for a repeat (run_shape)
    # SIGTERM unwinds like Ctrl-C: every process this bench started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.shape, args.steps = ["slime8"], 6
    names = [n for n in SHAPES if n != "tiny"] if "all" in args.shape else args.shape
    repeats = args.repeats
    tmp = Path(tempfile.mkdtemp(prefix="pipeline-"))
    rows = max(SHAPES[n].prompts + args.over_sampling for n in names) * (args.steps + 8)
    model, rows_path, prompt_tokens, obs_tokens = write_inputs(tmp, rows)
    paths = {"tmp": tmp, "model": model, "rows": rows_path}
    print(f"logs and configs: {tmp}; prompt {prompt_tokens} tokens, observation {obs_tokens}")
    lines = []
    for name in names:
        shape = SHAPES[name]
        args.repeats = repeats or (2 if name == "areal" else 1)
        results, floor = run_shape(shape, args, paths, prompt_tokens, obs_tokens)
        (tmp / f"{name}.json").write_text(json.dumps({m: asdict(r) for m, r in results.items()}))
        lines.append(last_line(name, results, floor, AREAL_RATIO if name == "areal" else None))
        print(lines[-1])
    if len(lines) > 1:
        print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
