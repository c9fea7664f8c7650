"""The chaos bench's fault kinds and how each is injected and recovered from (`bench/chaos.py`'s
docstring says what each kind does)."""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass
from typing import Any

from harness.chaos_hosts import HostedStack
from harness.chaos_proxy import FaultyProxy
from harness.chaos_stack import Monitor, Stack
from harness.link_proxy import LinkProxy
from harness.small_disk import SmallDisk

KINDS = [
    "kill:trainer",
    "kill:orchestrator",
    "kill:inference",
    "kill:retriever",
    "kill:redis",
    "refuse_push",
    "retriever_down",
    "pause:inference",
]
# Named with --kinds: a cluster's faults (issue 32), longer than the default mix's.
FREEZE_KINDS = [
    f"freeze:{s}" for s in ("trainer", "orchestrator", "inference", "retriever", "redis")
]
LINKS: dict[str, dict[str, Any]] = {  # what each link fault does (the module's docstring)
    "slow_link": {"delay_s": 0.3, "jitter_s": 0.2},
    "lossy_link": {"drop": 0.05, "cut": 0.03},
    "partition": {"stall": "both"},
    "partition_oneway": {"stall": "down"},  # requests arrive, their answers never come back
}
LINK_KINDS = [f"{k}:{s}" for k in LINKS for s in ("inference", "retriever")]
DISK_KINDS = ["disk_full:checkpoint", "disk_full:redis"]
# --hosts netns only: partitions at the switch between two hosts (a-b; one-way: a to b dropped).
CUT_KINDS = [
    "cut:trainer-redis",  # the lease's holder cut off from Redis: the standby takes over
    "cut:orchestrator-redis",
    "cut:orchestrator-inference",
    "cut:orchestrator-retriever",
    "cut:inference-trainer",  # an engine cut off from the trainer, mid-broadcast if one runs
    "cut_oneway:redis-trainer",  # Redis's answers to the holder lost, its requests arrive
    "cut_oneway:inference-orchestrator",  # the engine's answers lost
]
CLUSTER_KINDS = FREEZE_KINDS + LINK_KINDS + DISK_KINDS + CUT_KINDS
PROXY_KINDS = {"refuse_push", "retriever_down", *LINK_KINDS}  # loopback proxies: not with netns
OUTAGE_S = 30.0
DISK_BYTES = 8 * 2**30  # a disk_full tmpfs's cap; memory is used only as it is written
PUSH_PATH = "/update_weights_from_distributed"


@dataclass
class Fault:
    kind: str
    injected_at: float
    ended_at: float
    recovered_at: float | None = None
    refusals_before: int = 0  # refuse_push: the proxy's refusals before this one

    @property
    def recover_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.ended_at


def inject(
    kind: str,
    stack: Stack,
    proxies: dict[str, FaultyProxy],
    rng: random.Random,
    freeze_s: tuple[float, float] = (10.0, 90.0),
    links: dict[str, LinkProxy] | None = None,
    disks: dict[str, SmallDisk] | None = None,
    hosts: HostedStack | None = None,
    trainer: str = "trainer",
) -> tuple[Fault, str | None, int | None]:
    """Apply one fault; returns it with the service that must come back (and its old pid).
    `trainer`: the service a kind's `trainer` names (with a standby: the lease's holder)."""
    now = time.monotonic()
    action, _, target = kind.partition(":")
    if action in ("cut", "cut_oneway") and hosts is not None:
        a, b = (trainer if end == "trainer" else end for end in target.split("-", 1))
        hosts.net.cut(a, b, oneway=action == "cut_oneway")
        try:
            time.sleep(rng.uniform(*freeze_s))
        finally:  # a cut must never outlive the fault
            hosts.net.heal()
        return Fault(kind, now, time.monotonic()), None, None
    target = trainer if target == "trainer" else target
    if action in LINKS and links is not None:
        seconds = rng.uniform(*freeze_s)
        links[target].impair(seconds, **LINKS[action])
        time.sleep(seconds)
        return Fault(kind, now, time.monotonic()), None, None
    if action == "disk_full" and disks is not None:
        disks[target].fill_for(rng.uniform(*freeze_s))
        return Fault(kind, now, time.monotonic()), None, None
    if action == "kill":
        pid = stack.signal(target, signal.SIGKILL)
        return Fault(kind, now, now), target, pid
    if action in ("pause", "freeze"):
        stack.signal(target, signal.SIGSTOP)
        try:
            time.sleep(rng.uniform(*((5.0, 20.0) if action == "pause" else freeze_s)))
        finally:  # a stopped process must never outlive the bench
            stack.signal(target, signal.SIGCONT)
        return Fault(kind, now, time.monotonic()), None, None
    if kind == "retriever_down":
        proxies["retriever"].outage(OUTAGE_S)
        return Fault(kind, now, time.monotonic()), None, None
    if kind == "refuse_push":
        before = len(proxies["engine"].refused_at)
        proxies["engine"].refuse_next(PUSH_PATH)
        return Fault(kind, now, now, refusals_before=before), None, None
    raise ValueError(f"unknown fault kind {kind!r} (choose from {KINDS + CLUSTER_KINDS})")


def wait_recovered(
    fault: Fault,
    stack: Stack,
    monitor: Monitor,
    service: str | None,
    old_pid: int | None,
    proxies: dict[str, FaultyProxy],
    timeout_s: float,
) -> None:
    deadline = time.monotonic() + timeout_s
    refused = proxies["engine"].refused_at if "engine" in proxies else []
    while time.monotonic() < deadline and not stack.done:
        if fault.kind == "refuse_push":
            if len(refused) <= fault.refusals_before:  # no push has met the refusal yet
                time.sleep(0.2)
                continue
            fault.ended_at = refused[fault.refusals_before]
        back = service is None or stack.ready_again(service, old_pid)
        if back and monitor.step_after(fault.ended_at):
            fault.recovered_at = time.monotonic()
            return
        time.sleep(0.2)
    if stack.finished_at is not None and (service is None or stack.ready_again(service, old_pid)):
        fault.recovered_at = stack.finished_at  # the run completed after it
