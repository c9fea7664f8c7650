"""The chaos bench's fault schedule, up to K faults at once (`bench/chaos.py --concurrent K`).

Each fault runs on a thread of its own: its injection (a freeze or a cut lasts its duration) and
the wait for its recovery. A fault starts when fewer than K run and none of the running ones
touches one of its services (`services`): two freezes of Redis would end each other early, and
a service's fault must not hide another on the same service. The schedule's order is kept
except that a fault whose service is busy lets the next free one go first. Before each start
the bench's `stop_reason` is asked (the run finished, or too few steps are left to show a
recovery); its answer ends the schedule, and every fault not started is returned with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


def services(kind: str) -> frozenset[str]:
    """The services a fault kind acts on (`harness/chaos_faults.py`'s kinds)."""
    action, _, target = kind.partition(":")
    if kind == "refuse_push":
        return frozenset({"inference"})  # the engine's proxy
    if kind == "retriever_down":
        return frozenset({"retriever"})
    if action in ("cut", "cut_oneway"):
        return frozenset(target.split("-", 1))
    if action == "disk_full":
        return frozenset({"trainer" if target == "checkpoint" else target})
    return frozenset({target})


@dataclass
class Slot:
    """One fault's time on the schedule (monotonic seconds)."""

    index: int  # in the schedule
    kind: str
    started: float
    ended: float | None = None


class FaultScheduler:
    """Runs `run_fault(index, kind)` for each of `kinds`, at most `concurrent` at once."""

    def __init__(
        self,
        kinds: list[str],
        concurrent: int,
        run_fault: Callable[[int, str], None],
        *,
        stop_reason: Callable[[], str | None],
        gap_s: Callable[[int], float],
        poll_s: float = 0.05,
    ) -> None:
        """`stop_reason`: why no more faults may start (None: they may); `gap_s(index)`: the
        wait before that fault starts (a seeded random point of the next step)."""
        if concurrent < 1:
            raise ValueError(f"concurrent: at least 1 fault at a time, got {concurrent}")
        self.kinds = list(kinds)
        self.concurrent = concurrent
        self.run_fault = run_fault
        self.stop_reason = stop_reason
        self.gap_s = gap_s
        self.poll_s = poll_s
        self.slots: list[Slot] = []
        self.peak = 0  # the most faults that ran at once
        self.error: BaseException | None = None  # a fault's thread raised: nothing more starts
        self._running: dict[int, frozenset[str]] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _next(self, left: list[int]) -> int | None:
        """The first fault of `left` that may start now."""
        with self._lock:
            if len(self._running) >= self.concurrent:
                return None
            busy = frozenset().union(*self._running.values())
        return next((i for i in left if not services(self.kinds[i]) & busy), None)

    def _wait(self, seconds: float) -> str | None:
        """Sleep up to `seconds`; the stop reason as soon as there is one."""
        end = time.monotonic() + seconds
        while True:
            reason = self.stop_reason() or (repr(self.error) if self.error else None)
            if reason or time.monotonic() >= end:
                return reason
            time.sleep(min(self.poll_s, max(end - time.monotonic(), 0.0)))

    def run(self) -> tuple[list[str], str]:
        """Run the schedule; returns the kinds never started and why ("" when all were)."""
        left = list(range(len(self.kinds)))
        why = ""
        try:
            while left:
                index = self._next(left)
                if index is None:  # K running, or each left one's service busy: wait
                    why = self._wait(self.poll_s) or ""
                    if why:
                        break
                    continue
                why = self._wait(self.gap_s(index)) or ""
                if why:
                    break
                left.remove(index)
                self._start(index)
        finally:
            for thread in self._threads:
                thread.join()
        if self.error is not None:
            raise self.error
        return [self.kinds[i] for i in left], why

    def _start(self, index: int) -> None:
        kind = self.kinds[index]
        slot = Slot(index, kind, time.monotonic())
        with self._lock:
            self._running[index] = services(kind)
            self.peak = max(self.peak, len(self._running))
            self.slots.append(slot)

        def body() -> None:
            try:
                self.run_fault(index, kind)
            except BaseException as e:  # raised again by `run`, after the others end
                self.error = self.error or e
            finally:
                with self._lock:
                    slot.ended = time.monotonic()
                    del self._running[index]

        thread = threading.Thread(target=body, daemon=True, name=f"chaos-fault-{index}")
        self._threads.append(thread)
        thread.start()
