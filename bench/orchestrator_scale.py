"""How many samples one orchestrator process keeps in flight, at what CPU cost per turn.

Real `searchr1 orchestrator run` processes (sharing one run through Redis claims) against a
simulated engine and retriever (`harness.sim`: separate processes, the real HTTP protocols,
the shared cost model set to a fixed per-request and per-engine decode rate) and a real Redis
with the bus; a drainer in this process consumes and acks like a trainer. Sampled every 0.5 s:
each orchestrator's CPU time (/proc), the engine's served turns and requests in flight, the
retriever's in flight, trajectories drained.

The recipe is the original Search-R1's (512 prompts x 5 samples per step, up to 4 search rounds
plus the answer turn, observations cut at 500 tokens). `--profile` runs the first orchestrator
under cProfile and prints where its CPU goes by library.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m bench.orchestrator_scale
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from harness.child_process import wait_http
from searchr1.redis_server import RedisServer, free_port

CPU_BUDGET_MS = 2.0  # the goal: <= 2 ms of CPU per turn
CONCURRENCY_GOAL = 2560  # one original step (512 x 5) in flight in one process
CORE_SHARE = 0.8  # of one core an orchestrator process may use (headroom for bursts)
# The original recipe's rates: 2,560 trajectories per step; 133 s per step on 8 x H100 (RLinf:
# 55% less, ~60 s). Turns per trajectory come from the run (the simulated policy).
STEP_S_8GPU = 133 * 0.45

# The first orchestrator under cProfile, on only while the bench says (SIGUSR1 on, SIGUSR2 off:
# the steady window, not the start-up imports); written when the process exits.
PROFILE = """
import cProfile, runpy, signal, sys
sys.argv = ["searchr1"] + sys.argv[2:]
prof = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
signal.signal(signal.SIGUSR2, lambda *_: prof.disable())
try:
    runpy.run_module("stack.cli", run_name="__main__")
except SystemExit:
    pass
finally:
    prof.disable()
    prof.dump_stats(OUT)
"""

CATEGORIES = [  # (label, substrings of the file path or built-in's name), first match wins
    (
        "start-up (imports)",
        ("importlib", "marshal", "import_utils", "create_dynamic", "compile", "__build_class__"),
    ),
    (
        "http client (httpx, aiohttp, retries)",
        ("http", "h11", "anyio", "ssl", "tenacity", "urllib", "ipaddress", "inference/client"),
    ),
    ("tokenization", ("tokenizers", "transformers")),
    ("protobuf", ("protobuf", "_pb2", "/protos/", "upb")),
    ("redis", ("redis",)),
    ("json", ("json",)),
    ("sockets", ("socket",)),
    ("event loop", ("asyncio", "selectors", "select", "epoll", "concurrent/futures")),
    ("logging / metrics", ("logging", "prometheus")),
    ("orchestrator code", ("orchestrator/", "searchr1/")),
]


def write_inputs(tmp: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    from inference.tiny_model import make_tiny_model
    from orchestrator.prompt import make_row

    model = make_tiny_model(tmp / "model")
    rows = tmp / "rows.jsonl"
    n = args.groups_per_step * args.steps
    with rows.open("w") as f:
        for i in range(n):
            q = f"which river flows through city number {i} and who founded it"
            f.write(
                json.dumps(make_row(q, [f"answer {i}"], data_source="nq", split="train", index=i))
                + "\n"
            )
    return Path(model), rows


def write_config(
    tmp: Path, i: int, args: argparse.Namespace, urls: dict[str, str], model: Path, rows: Path
) -> Path:
    cfg = {
        "redis": {"url": urls["redis"]},
        "logging": {"level": "WARNING"},
        "run": {
            "id": "scale",
            "groups_per_step": args.groups_per_step,
            "group_size": args.group_size,
            "max_steps": args.steps,
        },
        "bus": {"max_backlog": 1_000_000},
        "engines": {"urls": [urls["engine"]]},
        "orchestrator": {
            "tokenizer_path": str(model),
            "mode": "async",
            "max_staleness": 1000,  # no trainer: never wait for weights
            "weight_poll_s": 0.1,
            "data": {"train_path": str(rows), "seed": 0},
            "rollout": {
                "turn_semantics": "original",
                "max_turns": 4,
                "max_tokens_per_turn": 512,
                "max_response_tokens": 8192,
                "observation_max_tokens": 500,
                "max_concurrent_samples": args.max_concurrent,
            },
            "search": {
                "retriever_url": urls["retriever"],
                "limits": {"max_concurrency": args.max_concurrent},
            },
            "partition": {"worker_id": f"orch-{i}"},
        },
    }
    path = tmp / f"orch-{i}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1"}
    env["PYTHONPATH"] = os.getcwd()
    with log.open("ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


async def drain(redis_url: str, counter: list[int], stop: asyncio.Event) -> None:
    from searchr1.bus import TrajectoryBus
    from searchr1.sections import BusConfig

    bus = TrajectoryBus.from_url(redis_url, BusConfig(consumer="bench"))
    try:
        while not stop.is_set():
            got = await bus.consume(2000, block=0.2)
            if got:
                await bus.ack(got)
                counter[0] += len(got)
    finally:
        await bus.close()


async def sample(
    procs: list[subprocess.Popen[bytes]],
    urls: dict[str, str],
    drained: list[int],
    timeout_s: float,
    profiled: subprocess.Popen[bytes] | None,
) -> list[dict[str, Any]]:
    ps = [psutil.Process(p.pid) for p in procs]
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as http:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError("orchestrators still running at the deadline")
            cpu = []
            for p in ps:
                try:
                    t = p.cpu_times()
                    cpu.append(t.user + t.system)
                except psutil.NoSuchProcess:
                    cpu.append(out[-1]["cpu"][len(cpu)] if out else 0.0)
            engine = (await http.get(f"{urls['engine']}/sim/stats")).json()
            retr = (await http.get(f"{urls['retriever']}/sim/stats")).json()
            if profiled is not None and profiled.poll() is None and engine["served"]:
                # Profile from the first served turn until fewer than half the peak are in
                # flight (the step's tail, then the exit): the sustained part.
                peak = max((x["in_flight"] for x in out), default=0)
                busy = engine["in_flight"] + retr["active"] >= peak / 2
                if not out or not out[-1]["turns"]:
                    profiled.send_signal(signal.SIGUSR1)
                elif not busy and out[-1]["in_flight"] >= peak / 2:
                    profiled.send_signal(signal.SIGUSR2)
            out.append(
                {
                    "t": time.monotonic(),
                    "cpu": cpu,
                    "turns": engine["served"],
                    "in_flight": engine["in_flight"] + retr["active"],
                    "drained": drained[0],
                }
            )
            await asyncio.sleep(0.5)
    return out


def summarize(samples: list[dict[str, Any]], n_procs: int) -> dict[str, float]:
    busy = [s for s in samples if s["turns"] > 0]
    first, last = busy[0], busy[-1]
    span = last["t"] - first["t"]
    turns = last["turns"] - first["turns"]
    cpu_s = sum(last["cpu"]) - sum(first["cpu"])
    in_flight = sorted(s["in_flight"] for s in busy)
    return {
        "window_s": span,
        "turns": turns,
        "turns_per_s": turns / span,
        "cpu_ms_per_turn": 1000 * cpu_s / max(1, turns),
        "cpu_cores": cpu_s / span,
        "in_flight_p90": in_flight[int(0.9 * (len(in_flight) - 1))] / n_procs,
        "in_flight_peak": in_flight[-1] / n_procs,
        "publish_per_s": (last["drained"] - first["drained"]) / span,
    }


def profile_breakdown(path: Path) -> list[tuple[str, float]]:
    stats = pstats.Stats(str(path))
    totals: dict[str, float] = {}
    for (file, _, func), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{file} {func}"
        if "poll' of 'select" in func or "method 'select'" in func:
            continue  # the event loop waiting for I/O: idle, not CPU (cProfile's clock is wall)
        label = next((lab for lab, keys in CATEGORIES if any(k in where for k in keys)), "other")
        totals[label] = totals.get(label, 0.0) + tottime
    total = sum(totals.values()) or 1.0
    return sorted(((k, v / total) for k, v in totals.items()), key=lambda kv: -kv[1])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--processes", type=int, default=1, help="orchestrator processes on the run")
    p.add_argument("--groups-per-step", type=int, default=512)
    p.add_argument("--group-size", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-concurrent", type=int, default=2560, help="per process")
    p.add_argument("--engines", type=int, default=8, help="simulated engines behind the router")
    p.add_argument("--decode-tok-s", type=float, default=50.0, help="per request")
    p.add_argument("--engine-tok-s", type=float, default=20000.0, help="per engine")
    p.add_argument("--turn-tokens", type=int, default=200, help="tokens per generated turn")
    p.add_argument("--p-search", type=float, default=0.6)
    p.add_argument("--search-median-ms", type=float, default=25.0)
    p.add_argument("--profile", action="store_true", help="cProfile the first one")
    p.add_argument("--timeout-s", type=float, default=1200)
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="orch-scale-"))
    model, rows = write_inputs(tmp, args)
    redis = RedisServer(data_dir=tmp / "redis", appendfsync="everysec").start()
    procs: list[subprocess.Popen[bytes]] = []
    py = sys.executable
    try:
        ports = {"engine": free_port(), "retriever": free_port()}
        urls = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()} | {"redis": redis.url}
        sims = []
        # A request alone decodes at decode_tok_s, an engine's batch at most at engine_tok_s;
        # prefill and KV reads free, no batch or memory limit: only the orchestrator is loaded.
        cost = {
            "step_fixed_s": 1 / args.decode_tok_s,
            "step_per_seq_s": 1 / args.engine_tok_s,
            "step_per_kv_token_s": 0.0,
            "prefill_tokens_per_s": 1e15,
            "max_running": 10**9,
            "kv_tokens": 10**15,
        }
        workload = {"p_search": args.p_search, "turn_median_tokens": args.turn_tokens,
                    "turn_sigma": 0.0}  # fmt: skip
        for kind, extra in (
            ("engine", ["--model", str(model), "--engines", str(args.engines),
                        "--cost", json.dumps(cost), "--workload", json.dumps(workload)]),
            ("retriever", ["--p50-ms", str(args.search_median_ms)]),
        ):  # fmt: skip
            log = tmp / f"{kind}.log"
            cmd = [py, "-m", f"harness.sim.{kind}", "--port", str(ports[kind]), *extra]
            sims.append(start(cmd, log))
            procs.append(sims[-1])
            wait_http(f"{urls[kind]}/health", sims[-1], log)
        orchs = []
        for i in range(args.processes):
            cfg = write_config(tmp, i, args, urls, model, rows)
            cli = ["orchestrator", "run", "--config", str(cfg), "--port", str(free_port())]
            if args.profile and i == 0:
                code = PROFILE.replace("OUT", repr(str(tmp / "orch.prof")))
                cmd = [py, "-c", code, "-", *cli]
            else:
                cmd = [py, "-m", "stack.cli", *cli]
            orchs.append(start(cmd, tmp / f"orch-{i}.log"))
        procs += orchs

        async def run() -> list[dict[str, Any]]:
            drained, stop = [0], asyncio.Event()
            drainer = asyncio.create_task(drain(redis.url, drained, stop))
            try:
                return await sample(
                    orchs, urls, drained, args.timeout_s, orchs[0] if args.profile else None
                )
            finally:
                await asyncio.sleep(1.0)
                stop.set()
                await drainer

        samples = asyncio.run(run())
        for i, o in enumerate(orchs):
            if o.returncode != 0:
                raise RuntimeError(
                    f"orchestrator {i} exited {o.returncode}: "
                    + (tmp / f"orch-{i}.log").read_text()[-3000:]
                )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(15)
        redis.close()

    (tmp / "series.json").write_text(json.dumps(samples))
    print(f"time series: {tmp / 'series.json'}")
    s = summarize(samples, args.processes)
    turns_per_sample = s["turns"] / max(1, args.groups_per_step * args.group_size * args.steps)
    print(
        f"recipe: {args.groups_per_step} x {args.group_size} per step, {args.steps} steps, "
        f"{args.processes} process(es), {args.engines} simulated engines "
        f"({args.decode_tok_s:g} tok/s per request, {args.engine_tok_s:g} per engine), "
        f"{args.turn_tokens} tokens per turn, search median {args.search_median_ms:g} ms"
    )
    print(
        f"window {s['window_s']:.1f} s: {s['turns']} turns ({turns_per_sample:.2f} per sample), "
        f"{s['turns_per_s']:.1f} turns/s, {s['publish_per_s']:.1f} trajectories/s published"
    )
    print(
        f"per process: in flight p90 {s['in_flight_p90']:.0f} (peak {s['in_flight_peak']:.0f}; "
        f"{s['in_flight_p90'] / CONCURRENCY_GOAL:.2f}x the {CONCURRENCY_GOAL} goal), "
        f"CPU {s['cpu_cores']:.2f} cores, {s['cpu_ms_per_turn']:.2f} ms per turn "
        f"({s['cpu_ms_per_turn'] / CPU_BUDGET_MS:.2f}x the {CPU_BUDGET_MS:g} ms budget)"
    )
    if args.profile:
        print("where the first process's CPU goes (cProfile self time, I/O waits left out):")
        for label, share in profile_breakdown(tmp / "orch.prof"):
            print(f"  {label:34s} {100 * share:5.1f}%")
        stats = pstats.Stats(str(tmp / "orch.prof"))
        stats.sort_stats("tottime").print_stats(15)
    # Capacity: a process is limited by its CPU (turns/s at CORE_SHARE of a core) and by the
    # samples it holds; a run needs enough processes for both.
    per_proc_turns = 1000 * CORE_SHARE / s["cpu_ms_per_turn"]
    need = {}
    for gpus in (8, 64):
        scale = gpus / 8  # the batch (and the turn rate) grows with the engines
        turns_needed = scale * CONCURRENCY_GOAL * turns_per_sample / STEP_S_8GPU
        samples_needed = scale * CONCURRENCY_GOAL
        need[gpus] = max(
            math.ceil(turns_needed / per_proc_turns),
            math.ceil(samples_needed / max(1.0, s["in_flight_p90"])),
        )
        print(
            f"{gpus} GPUs: {turns_needed:.0f} turns/s (/{per_proc_turns:.0f} per process at "
            f"{CORE_SHARE:g} core), {samples_needed:.0f} samples in flight "
            f"(/{s['in_flight_p90']:.0f} per process) -> {need[gpus]} process(es)"
        )
    print(
        f"turns_per_s_per_process={s['turns_per_s'] / args.processes:.1f} "
        f"cpu_ms_per_turn={s['cpu_ms_per_turn']:.3f} "
        f"max_concurrent_samples={s['in_flight_p90']:.0f} "
        f"processes_for_8gpu={need[8]} processes_for_64gpu={need[64]}"
    )


if __name__ == "__main__":
    main()
