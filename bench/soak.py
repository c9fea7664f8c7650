"""Soak: the full local stack for hours with a fault every few minutes; does anything grow?

The chaos bench's stack (`bench/chaos.py`: the demo's world, index and warm start, Redis and the
services under `searchr1.supervisor` with restarts on, `harness/chaos_stack.py`) trains for
`--duration-s` (default 2 hours; the run's steps are more than it can finish) while a fault from
the chaos mix (`harness/chaos_faults.py`; `--kinds` as there, without the full-disk and netns
kinds) is injected every `--fault-every-s` and recovered from. Every `--sample-s` it samples:

- each service (redis, retriever, inference, orchestrator, trainer) as its process and every
  descendant: RSS, open file descriptors, threads;
- Redis: `used_memory`, the key count, each stream's length (the bus, its dead letters), and
  at the end its keys by family (count and bytes): what a growing figure is made of;
- the bytes allocated under the run directory by its parts (Redis's AOF, checkpoints, the
  services' logs, the trainer's step lines), and in all but the records (`disk_state_mb`);
- the step time (the median gap of the trainer's last 8 step lines).

After the run each figure's growth per hour is fitted over its samples after `--warmup-s` and
called a leak or flat by the rule in `harness/soak.py` (significant, large relative to its level,
and a climb rather than one step). A fault that kills a service restarts it, so that service's
figures start again from a fresh process: its leak shows between its kills (the default mix
kills each service about once every 8 faults).

The bus keeps consumed trajectory ids for `bus.dedup_retention_s` (7 days): bounded, but far
beyond a soak, where it would read as a climb; the soak sets it to `--dedup-retention-s` (600 s,
about the warm-up) so that bound is reached and must hold while the figures are fitted; likewise
Redis rewrites its AOF from 2 MB (`AOF_REWRITE_MIN`) instead of 64 MB. The services' logs and
the trainer's step lines are records, a line per event: they grow with the run by design (`searchr1
local` does not rotate logs), so their figures are printed with the verdict `record`, never
counted as leaks. Every sample is written to `<out>/soak_samples.json`.

Its last line: `<figure>_per_h=<growth per hour>` for every figure (MB for memory and disk,
counts for the rest, seconds for the step time), then `leaks=N`. Exit 1 when a figure leaks
(unless `--allow-leaks`: the CI's short form, minutes too few to tell a leak from a warm-up),
the stack stopped, or a fault did not recover; each reason on a `FAILED:` line.
Run from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python -P bench/soak.py [--duration-s 7200] [--quick]
        [--fault-every-s 300] [--sample-s 10] [--warmup-s 600] [--out DIR] [--seed 0]
        [--kinds K,...] [--freeze-s 10,90] [--groups-per-step 8] [--group-size 4]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
import yaml

from bench.chaos import (
    ChaosConfig,
    build_world,
    fault_kinds,
    wire_fault_proxies,
    write_run_config,
)
from harness.chaos_faults import CLUSTER_KINDS, DISK_KINDS, KINDS, Fault, inject, wait_recovered
from harness.chaos_stack import Monitor, Stack
from harness.soak import (
    Growth,
    disk_bytes,
    growth,
    key_families,
    process_tree,
    redis_figures,
)
from searchr1.redis_server import RedisServer, free_port

MB = 2**20
RECOVER_S = 300.0  # a fault not recovered within this fails the soak
RECORD = "record"  # the verdict of a record's figure (the module docstring)
# Redis rewrites its AOF once it has doubled since the last rewrite and is at least this big
# (64 MB by default: hours of a soak's writes, which would read as a climb).
AOF_REWRITE_MIN = "2mb"


class SoakRedis(RedisServer):
    """The stack's Redis with the AOF's rewrite threshold within a soak's reach."""

    def command(self) -> list[str]:
        return [*super().command(), "--auto-aof-rewrite-min-size", AOF_REWRITE_MIN]


NOT_HERE = {*DISK_KINDS, *(k for k in CLUSTER_KINDS if k.startswith(("cut:", "cut_oneway:")))}


@dataclass(frozen=True)
class SoakConfig:
    out_dir: Path
    duration_s: float = 7200.0
    fault_every_s: float = 300.0
    sample_s: float = 10.0
    warmup_s: float = 600.0
    seed: int = 0
    kinds: tuple[str, ...] = ()  # empty: seeded shuffles of the chaos mix (KINDS)
    freeze_s: tuple[float, float] = (10.0, 90.0)
    quick: bool = False
    groups_per_step: int = 8
    group_size: int = 4
    dedup_retention_s: float = 600.0  # the bus's done set (7 days by default): the docstring

    def chaos(self) -> ChaosConfig:
        """The chaos bench's config for this soak: its faults, and steps it cannot run out of
        (a step takes seconds here)."""
        return ChaosConfig(
            out_dir=self.out_dir,
            seed=self.seed,
            faults=int(self.duration_s // self.fault_every_s) + 1,
            kinds=self.kinds,
            quick=self.quick,
            max_steps=int(self.duration_s) + 100,
            groups_per_step=self.groups_per_step,
            group_size=self.group_size,
            freeze_s=self.freeze_s,
        )


@dataclass
class Samples:
    """Each figure's samples: (seconds since the first, value)."""

    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    start: float = field(default_factory=time.monotonic)
    records: set[str] = field(default_factory=set)  # the run directory's parts that are records

    def is_record(self, figure: str) -> bool:
        return any(figure == f"disk_{figure_name(name)}_mb" for name in self.records)

    def add(self, figure: str, value: float, at: float) -> None:
        times, values = self.series.setdefault(figure, ([], []))
        times.append(at - self.start)
        values.append(value)


def figure_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()


def sample(
    stack: Stack, client: redis.Redis, monitor: Monitor, run_dir: Path, out: Samples
) -> None:
    now = time.monotonic()
    for child in stack.sup.children:
        tree = process_tree(child.pid) if child.pid is not None else None
        if tree is None:  # restarting after a fault
            continue
        name = figure_name(child.spec.name)
        out.add(f"{name}_rss_mb", tree.rss_bytes / MB, now)
        out.add(f"{name}_fds", tree.fds, now)
        out.add(f"{name}_threads", tree.threads, now)
    try:
        figures = redis_figures(client)
    except redis.RedisError:  # down or frozen (a fault): its figures are missing this time
        figures = {}
    for key, value in figures.items():
        if key.startswith("stream:"):
            out.add(f"stream_{figure_name(key[7:])}_len", value, now)
        else:
            out.add(f"redis_{key}" + ("_mb" if key == "used_memory" else ""),
                    value / MB if key == "used_memory" else value, now)  # fmt: skip
    state = 0
    for entry in sorted(run_dir.iterdir()):  # each part apart: what a growing total is made of
        size = disk_bytes(entry)
        out.add(f"disk_{figure_name(entry.name)}_mb", size / MB, now)
        state += 0 if entry.name in out.records else size
    out.add("disk_state_mb", state / MB, now)
    gaps = [b - a for a, b in zip(monitor.step_times[-9:], monitor.step_times[-8:], strict=False)]
    if len(gaps) >= 3:
        out.add("step_s", statistics.median(gaps), now)


class FaultLoop(threading.Thread):
    """One fault every `fault_every_s` (the first one after one period), each waited on until
    recovered; until stopped or the schedule is done."""

    def __init__(self, cfg: SoakConfig, stack: Stack, monitor: Monitor, ctx: dict[str, Any]):
        super().__init__(daemon=True, name="soak-faults")
        self.cfg, self.stack, self.monitor, self.ctx = cfg, stack, monitor, ctx
        self.rng = random.Random(cfg.seed)
        self.schedule = fault_kinds(cfg.chaos(), self.rng)
        self.faults: list[Fault] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        proxies, links = self.ctx["proxies"], self.ctx["links"]
        for i, kind in enumerate(self.schedule):
            if self.stop_event.wait(self.cfg.fault_every_s) or self.stack.done:
                return
            fault, service, pid = inject(
                kind, self.stack, proxies, self.rng, self.cfg.freeze_s, links
            )
            self.faults.append(fault)
            print(f"fault {i + 1}: {kind} at step {self.monitor.steps_done}", flush=True)
            wait_recovered(fault, self.stack, self.monitor, service, pid, proxies, RECOVER_S)
            rec = "-" if fault.recover_s is None else f"{fault.recover_s:.1f}s"
            print(f"  recovered: {rec}", flush=True)


def run(cfg: SoakConfig) -> tuple[Samples, list[Fault], Stack, dict[str, tuple[int, int]]]:
    """The soak: the stack, its faults and its samples until `duration_s` has passed."""
    chaos = cfg.chaos()
    demo, index_dir, warm, rows = build_world(chaos)
    run_dir = cfg.out_dir / "run-soak"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    server = SoakRedis(port=free_port(), data_dir=run_dir / "redis")
    path, data = write_run_config(chaos, demo, run_dir, (index_dir, warm, rows), server.url)
    # The chaos bench's proxies, for its refused push, retriever outage and link faults.
    proxies, links = wire_fault_proxies(data, cfg.seed)
    data.setdefault("bus", {})["dedup_retention_s"] = cfg.dedup_retention_s
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    stack = Stack(path, data, server)
    jsonl = Path(data["trainer"]["metrics_jsonl"])
    monitor = Monitor(server.url, stack.cfg.bus.stream, jsonl)
    client = redis.Redis.from_url(server.url, socket_timeout=2.0, socket_connect_timeout=2.0)
    faults = FaultLoop(cfg, stack, monitor, {"proxies": proxies, "links": links})
    samples = Samples()
    samples.records = {Path(data["local"]["log_dir"]).name, jsonl.name}
    families: dict[str, tuple[int, int]] = {}
    try:
        stack.thread.start()
        monitor.start()
        while monitor.steps_done < 1 and not stack.done:
            time.sleep(0.5)
        if stack.done:
            return samples, faults.faults, stack, families
        print(f"stack ready, first step done: sampling for {cfg.duration_s:.0f}s", flush=True)
        samples.start = time.monotonic()
        end = samples.start + cfg.duration_s
        faults.start()
        while time.monotonic() < end and not stack.done:
            sample(stack, client, monitor, run_dir, samples)
            time.sleep(max(0.0, min(cfg.sample_s, end - time.monotonic())))
        faults.stop_event.set()  # no new fault; the one under way recovers (or times out) first
        faults.join(cfg.freeze_s[1] + RECOVER_S + 10)
        try:
            families = key_families(client)
        except redis.RedisError:
            families = {}
    finally:
        faults.stop_event.set()
        faults.join(cfg.freeze_s[1] + 10)  # interrupted: a freeze under way ends (SIGCONT) first
        stack.stop()
        monitor.stop_event.set()
        monitor.join(5)
        client.close()
        for proxy in proxies.values():
            proxy.stop()
        for link in links.values():
            link.stop()
    return samples, faults.faults, stack, families


def verdicts(cfg: SoakConfig, samples: Samples) -> list[Growth]:
    return [
        growth(name, times, values, warmup_s=cfg.warmup_s)
        for name, (times, values) in sorted(samples.series.items())
    ]


def leaks(results: list[Growth], samples: Samples) -> list[str]:
    return [g.figure for g in results if g.leak and not samples.is_record(g.figure)]


def report(results: list[Growth], samples: Samples) -> str:
    """A table of every figure, and the last line."""
    head = ("figure", "n", "level", "per_h", "rel/h", "p")
    print("{:34s} {:>5s} {:>10s} {:>10s} {:>7s} {:>8s}  verdict".format(*head))
    for g in results:
        step = " (one step fits better)" if g.step_fits_better and g.per_h > 0 else ""
        verdict = RECORD if samples.is_record(g.figure) else g.verdict
        print(
            f"{g.figure:34s} {g.samples:5d} {g.level:10.2f} {g.per_h:10.3f} "
            f"{g.rel_per_h:7.1%} {g.p:8.2g}  {verdict}{step}"
        )
    pairs = [f"{g.figure}_per_h={g.per_h:.3f}" for g in results]
    return " ".join([*pairs, f"leaks={len(leaks(results, samples))}"])


def failures(cfg: SoakConfig, stack: Stack, samples: Samples, faults: list[Fault]) -> list[str]:
    why = []
    if stack.error is not None:
        why.append(f"the stack stopped: {stack.error!r}")
    elif stack.finished_at is not None:
        why.append("the run finished its steps before the soak's duration")
    unrecovered = [f.kind for f in faults if f.recovered_at is None]
    if unrecovered:
        why.append(f"not recovered: {', '.join(unrecovered)}")
    if not samples.series:
        why.append("no sample taken")
    return why


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: every `finally` stops what it started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/soak"))
    ap.add_argument("--duration-s", type=float, default=7200.0)
    ap.add_argument("--fault-every-s", type=float, default=300.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=600.0, help="samples before are not fitted")
    ap.add_argument("--seed", type=int, default=0, help="world, warm start, fault schedule")
    ap.add_argument("--kinds", default="", help=f"comma list, cycled (default: {KINDS})")
    ap.add_argument("--freeze-s", default="10,90", help="a freeze's or outage's MIN,MAX seconds")
    ap.add_argument("--quick", action="store_true", help="the quick demo's world and warm start")
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument(
        "--dedup-retention-s",
        type=float,
        default=600.0,
        help="the bus's done set's retention (bus.dedup_retention_s), reached within the warm-up",
    )
    ap.add_argument("--allow-leaks", action="store_true", help="exit 0 with leaks (short runs)")
    args = ap.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    for k in kinds:
        if k not in KINDS + CLUSTER_KINDS or k in NOT_HERE:
            ap.error(f"--kinds: {k!r} is not a soak's fault (choose from {KINDS}, freeze:*, links)")
    try:
        lo, hi = (float(x) for x in args.freeze_s.split(","))
        assert 0 < lo <= hi
    except (ValueError, AssertionError):
        ap.error(f"--freeze-s: expected MIN,MAX seconds with 0 < MIN <= MAX, got {args.freeze_s!r}")
    if min(args.duration_s, args.fault_every_s, args.sample_s) <= 0:
        ap.error("--duration-s, --fault-every-s and --sample-s must be > 0")
    cfg = SoakConfig(
        out_dir=args.out.resolve(),
        duration_s=args.duration_s,
        fault_every_s=args.fault_every_s,
        sample_s=args.sample_s,
        warmup_s=args.warmup_s,
        seed=args.seed,
        kinds=kinds,
        freeze_s=(lo, hi),
        quick=args.quick,
        groups_per_step=args.groups_per_step,
        group_size=args.group_size,
        dedup_retention_s=args.dedup_retention_s,
    )
    import logging

    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGTERM, _interrupt)
    start = time.monotonic()
    samples, faults, stack, families = run(cfg)
    results = verdicts(cfg, samples)
    saved = {"records": sorted(samples.records), "series": samples.series}
    (cfg.out_dir / "soak_samples.json").write_text(json.dumps(saved))
    restarts = {c.spec.name: c.restarts for c in stack.sup.children}
    print(f"wall_s={time.monotonic() - start:.0f} faults={len(faults)} restarts={restarts}")
    print("redis keys by family at the end (count, bytes):")
    for family, (count, size) in sorted(families.items(), key=lambda kv: -kv[1][1])[:10]:
        print(f"  {family:60s} {count:7d} {size:10d}")
    line = report(results, samples)
    why = failures(cfg, stack, samples, faults)
    leaking = leaks(results, samples)
    if leaking and not args.allow_leaks:
        why.append(f"leaks: {', '.join(leaking)}")
    for reason in why:
        print(f"FAILED: {reason}", flush=True)
        print(f"soak: FAILED: {reason}", file=sys.stderr, flush=True)
    print(line, flush=True)  # the last line: what the tests and docs read
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
