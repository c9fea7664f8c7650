"""harness/chaos_schedule.FaultScheduler (`bench/chaos.py --concurrent K`, issue 46): never more
than K faults at once, never two on one service, every fault started or the reason it was not."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest

from harness.chaos_schedule import FaultScheduler, Slot, services

MIX = [
    "kill:trainer", "kill:redis", "freeze:redis", "freeze:inference", "pause:inference",
    "refuse_push", "retriever_down", "kill:retriever", "slow_link:retriever",
    "disk_full:checkpoint", "freeze:trainer", "kill:orchestrator",
]  # fmt: skip


def overlapping(a: Slot, b: Slot) -> bool:
    assert a.ended is not None and b.ended is not None
    return a.started < b.ended and b.started < a.ended


def sleeping(kinds: list[str], k: int) -> FaultScheduler:
    """Faults that last 20-80 ms each, 5 ms apart."""
    rng = random.Random(0)
    durations = [rng.uniform(0.02, 0.08) for _ in kinds]
    return FaultScheduler(
        kinds,
        k,
        lambda i, kind: time.sleep(durations[i]),
        stop_reason=lambda: None,
        gap_s=lambda i: 0.005,
        poll_s=0.002,
    )


@pytest.mark.parametrize("k", [1, 2, 3])
def test_at_most_k_at_once_and_never_two_on_one_service(k: int) -> None:
    kinds = MIX * 2
    sched = sleeping(kinds, k)
    left, why = sched.run()
    assert (left, why) == ([], "")
    assert sorted(s.index for s in sched.slots) == list(range(len(kinds)))  # each started once
    for t in sorted({s.started for s in sched.slots}):  # at each start, who is running
        running = [s for s in sched.slots if s.started <= t < s.ended]  # type: ignore[operator]
        assert len(running) <= k
    for a, b in itertools.combinations(sched.slots, 2):
        if overlapping(a, b):
            assert not services(a.kind) & services(b.kind), (a, b)
    if k > 1:
        assert sched.peak == k  # the mix has room for K at once: they do overlap


def test_services_of_each_kind() -> None:
    assert services("kill:redis") == services("freeze:redis") == services("disk_full:redis")
    assert services("refuse_push") == services("pause:inference") == {"inference"}
    assert services("cut:trainer-redis") == {"trainer", "redis"}
    assert services("disk_full:checkpoint") == {"trainer"}
    assert services("retriever_down") == services("lossy_link:retriever") == {"retriever"}


def test_a_busy_service_lets_the_next_free_fault_go_first() -> None:
    order: list[str] = []
    gate = threading.Event()

    def fault(i: int, kind: str) -> None:
        order.append(kind)
        if kind == "freeze:redis":
            gate.wait(5)  # Redis stays frozen until the trainer's kill has started

    def release(i: int) -> float:
        if i == 2:
            gate.set()
        return 0.0

    kinds = ["freeze:redis", "kill:redis", "kill:trainer"]
    sched = FaultScheduler(kinds, 2, fault, stop_reason=lambda: None, gap_s=release, poll_s=0.002)
    assert sched.run() == ([], "")
    assert order == ["freeze:redis", "kill:trainer", "kill:redis"]


def test_the_faults_not_started_come_back_with_the_reason() -> None:
    started: list[int] = []
    stop = threading.Event()

    def fault(i: int, kind: str) -> None:
        started.append(i)
        if len(started) == 3:
            stop.set()  # the run reached its last step

    sched = FaultScheduler(
        MIX,
        1,
        fault,
        stop_reason=lambda: "the run's steps ran out" if stop.is_set() else None,
        gap_s=lambda i: 0.0,
        poll_s=0.002,
    )
    left, why = sched.run()
    assert started == [0, 1, 2]
    assert (left, why) == (MIX[3:], "the run's steps ran out")


def test_a_fault_that_raises_stops_the_schedule_and_is_raised() -> None:
    def fault(i: int, kind: str) -> None:
        if i == 1:
            raise RuntimeError("no such service")
        time.sleep(0.05)

    sched = FaultScheduler(MIX, 2, fault, stop_reason=lambda: None, gap_s=lambda i: 0.01)
    with pytest.raises(RuntimeError, match="no such service"):
        sched.run()
    assert len(sched.slots) < len(MIX)
    assert all(s.ended is not None for s in sched.slots)  # every started fault ended first


def test_concurrent_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="concurrent"):
        FaultScheduler(MIX, 0, lambda i, k: None, stop_reason=lambda: None, gap_s=lambda i: 0)
