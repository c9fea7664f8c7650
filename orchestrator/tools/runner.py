"""What every tool call gets: a global concurrency cap, a deadline per attempt, bounded retries,
a circuit breaker, an explicit outcome, and metrics labelled by tool.

An exhausted retry budget is an explicit outcome (`Outcome.error`): the rollout shows the
policy a failure observation and records the error on the turn. Nothing becomes a silent empty
result (slime's client defect).

The breaker opens when a call's retries are exhausted and the tool's readiness probe fails too
(an outage; not a bad call), or after `breaker_failures` exhausted calls in a row (a tool that
says it is ready but fails). While it is open, calls wait (the probe asked every
`breaker_probe_s`) instead of turning an outage into training data that says the tool does not
pay; so do the calls in flight when it went down: they try again once it is back. A call waits
at most `breaker_max_wait_s` in all. The first successful probe closes the breaker. A tool
without a probe (no `ready`) is taken as ready: its breaker then is a cool-down of
`breaker_probe_s` after `breaker_failures` failures in a row. Open/closed is a gauge and a log
line each way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from orchestrator.config import CallLimits
from orchestrator.tools.base import ToolError
from orchestrator.tools.metrics import RunnerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Outcome(Generic[T]):
    value: T | None = None
    attempts: int = 0
    latency_s: float = 0.0
    error: str = ""
    # The error is the call's own (a bad request, bad arguments): retrying cannot help, and
    # it says nothing about the tool's health.
    call_error: bool = False


def not_the_calls_fault(exc: BaseException) -> bool:
    """Retry anything but a `ToolError` (the call's own fault)."""
    return not isinstance(exc, ToolError)


class ToolRunner:
    """Runs one tool's calls under its `CallLimits`; `ready` is its readiness probe (optional)."""

    def __init__(
        self,
        limits: CallLimits,
        metrics: RunnerMetrics,
        *,
        ready: Callable[[], Awaitable[bool]] | None = None,
        retryable: Callable[[BaseException], bool] = not_the_calls_fault,
        service: str | None = None,
    ) -> None:
        self.limits = limits
        self.metrics = metrics
        self.service = service or f"tool {metrics.tool!r}"  # as named in messages
        self._probe = ready
        self._retryable = retryable
        self._sem = asyncio.Semaphore(limits.max_concurrency)
        self._outage_logged = False
        self._failures_in_a_row = 0
        self._down = False  # the open breaker's cause is a failing probe (an outage)
        self._closed = asyncio.Event()  # set: the breaker is closed (calls go through)
        self._closed.set()
        self._prober: asyncio.Task[None] | None = None
        self._ready_probe: asyncio.Future[bool] | None = None  # the probe call in flight

    @property
    def breaker_open(self) -> bool:
        return not self._closed.is_set()

    def _record(self, failed: bool) -> None:
        if not failed:
            self._failures_in_a_row = 0
            return
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= self.limits.breaker_failures:
            self._open(f"{self._failures_in_a_row} calls failed in a row", down=False)

    def _open(self, reason: str, *, down: bool) -> None:
        self._down = self._down or down
        if self.breaker_open:
            return
        self._closed.clear()
        self.metrics.breaker(True)
        log.warning(
            f"{self.service} circuit breaker open: calls wait for it",
            extra={"reason": reason, "tool": self.metrics.tool},
        )
        self._prober = asyncio.create_task(self._probe_until_ready())

    async def _ready(self) -> bool:
        """The tool's probe. Calls whose retries run out together (an outage) share the probe
        in flight instead of sending one each."""
        if self._ready_probe is None or self._ready_probe.done():
            self._ready_probe = asyncio.ensure_future(self._probe_ready())
        # shielded: one waiter cancelled (its rollout stopped) does not cancel the others' probe
        return await asyncio.shield(self._ready_probe)

    async def _probe_ready(self) -> bool:
        if self._probe is None:
            return True
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                return await self._probe()
        except Exception:
            return False

    async def _probe_until_ready(self) -> None:
        while True:
            await asyncio.sleep(self.limits.breaker_probe_s)
            if await self._ready():
                break
        self._failures_in_a_row = 0
        self._down = False
        self._closed.set()
        self.metrics.breaker(False)
        log.info(f"{self.service} circuit breaker closed: it answers again")

    async def _wait_closed(self, deadline: float) -> bool:
        """Wait for the breaker to close until `deadline` (loop time); False if it did not."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._closed.wait()
            return True
        except TimeoutError:
            return False

    async def _attempts(self, fn: Callable[[], Awaitable[T]], out: Outcome[T]) -> Exception | None:
        """One call with its retries; the error that exhausted them, or None."""

        def before_sleep(state: RetryCallState) -> None:
            self.metrics.retry()

        lim = self.limits
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(self._retryable),
                stop=stop_after_attempt(lim.max_attempts),
                wait=wait_exponential_jitter(
                    multiplier=lim.backoff_initial_s,
                    max=lim.backoff_max_s,
                    jitter=lim.backoff_initial_s,
                ),
                before_sleep=before_sleep,
                reraise=True,
            ):
                with attempt:
                    out.attempts += 1
                    async with self._sem:
                        async with asyncio.timeout(lim.timeout_s):
                            out.value = await fn()
        except Exception as e:
            return e
        return None

    async def run(self, fn: Callable[[], Awaitable[T]]) -> Outcome[T]:
        """`fn()` under the limits: never raises for the tool's trouble (see `Outcome.error`)."""
        start = time.perf_counter()
        out: Outcome[T] = Outcome()
        loop = asyncio.get_running_loop()
        deadline: float | None = None  # set when this call first waits for the breaker
        error: Exception | None = None
        while True:
            if self.breaker_open:
                deadline = deadline or loop.time() + self.limits.breaker_max_wait_s
                if not await self._wait_closed(deadline):
                    out.value = None
                    out.error = (
                        f"{self.service} down for more than {self.limits.breaker_max_wait_s}s"
                    )
                    if error is not None:
                        out.error += f" ({self._describe(error)})"
                    self.metrics.failure("CircuitOpen")
                    break
            error = await self._attempts(fn, out)
            if error is None:
                self._outage_logged = False
                self._record(failed=False)
                break
            if not self._retryable(error):  # the call's own fault
                self._fail(out, error)
                out.call_error = True
                break
            # Exhausted retries: an outage if the probe fails too. Then this call waits for
            # the tool like a new one instead of becoming a failure observation.
            down = self._down or not await self._ready()
            if down:
                self._open("a call's retries ran out and its probe fails", down=True)
            self._record(failed=True)
            if not down or (deadline is not None and loop.time() >= deadline):
                self._fail(out, error)
                break
            self.metrics.retry()
        out.latency_s = time.perf_counter() - start
        self.metrics.latency(out.latency_s)
        return out

    def _describe(self, e: Exception) -> str:
        if isinstance(e, TimeoutError):
            return f"timed out after {self.limits.timeout_s}s"
        if isinstance(e, ToolError):
            return str(e) or type(e).__name__
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    def _fail(self, out: Outcome[T], e: Exception) -> None:
        out.value = None
        out.error = self._describe(e)
        self.metrics.failure(type(e).__name__)
        if not self._outage_logged:  # once per outage, not once per call
            self._outage_logged = True
            log.warning(
                f"{self.service}: call failed after retries",
                extra={"attempts": out.attempts, "error": out.error, "tool": self.metrics.tool},
            )
