"""Pausing generation for a weight update (SGLang's `/pause_generation` .. `/continue_generation`),
held by a lease.

A pause stops decode steps; its mode says what happens to the requests in flight: `abort`
finishes them with finish_reason abort, `in_place` keeps them where they are, `retract` puts
them back in the queue (re-admission recomputes their K/V under the weights current then).
The trainer renews the lease with every weight-update call; a pause that runs out without a
`continue_generation` resumes by itself and drops the push it held open (the trainer vanished
mid-push), so an engine never stays paused for good.

Every method runs on the scheduler thread (engine commands), so no lock is needed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import Counter

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")

PAUSE_EXPIRED = Counter(
    "searchr1_inference_pause_leases_expired_total",
    "Pauses that ran out without a continue_generation (the trainer vanished mid-push)",
)


def check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {list(PAUSE_MODES)} (got {mode!r})")


class PauseLease:
    """Whether generation is paused, and until when the pause holds without a renewal."""

    def __init__(self, lease_s: float, on_expire: Callable[[], bool]) -> None:
        """`on_expire` drops the push the pause held open; it returns whether one was open."""
        self.lease_s = lease_s
        self.on_expire = on_expire
        self.paused = False
        self.deadline = 0.0  # monotonic; renewed by every weight-update call
        self.expired = 0  # pauses that ran out

    def hold(self) -> None:
        self.paused = True
        self.renew()

    def release(self) -> None:
        self.paused = False

    def renew(self) -> None:
        """The trainer is alive: keep a pause for another `lease_s`."""
        self.deadline = time.monotonic() + self.lease_s

    def left(self) -> float:
        """Seconds until the pause runs out (<= 0: it has)."""
        return self.deadline - time.monotonic()

    def expire(self) -> None:
        """The pause ran out without a continue: resume and drop the push."""
        self.paused = False
        self.expired += 1
        PAUSE_EXPIRED.inc()
        dropped = self.on_expire()
        log.warning(
            "pause lease expired: resuming generation (the trainer vanished mid-push?)",
            extra={"pause_lease_s": self.lease_s, "dropped_open_push": dropped},
        )
