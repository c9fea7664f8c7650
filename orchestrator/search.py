"""The search tool: a global concurrency cap, a timeout per attempt, bounded retries, and a
circuit breaker.

An exhausted retry budget is an explicit outcome (`SearchOutcome.error`): the rollout shows the
policy a failure observation, records the error on the turn, flags the sample as an
infrastructure failure (left out of training by default) and counts it. Nothing becomes a
silent empty `<information></information>` (slime's client defect).

The breaker opens when a search's retries are exhausted and the retriever's /ready fails too
(an outage, or a restarted retriever still loading its index, whose /health answers at once;
not a bad query), or after `breaker_failures` exhausted searches in a row (a retriever that
says it is ready but fails searches). While it is open, searches wait (the retriever's /ready
probed every `breaker_probe_s`) instead of turning a retriever outage into
training data that says searching does not pay; so do the searches that were in flight when it
went down: they try again once it is back. A search waits at most `breaker_max_wait_s` in all.
The first successful probe closes the breaker. Open/closed is a gauge, a log line each way,
and the orchestrator's /ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from orchestrator import metrics
from orchestrator.config import SearchConfig
from retriever.client import RetrieverBadRequest

log = logging.getLogger(__name__)


class SearchClient(Protocol):
    async def search(self, queries: list[str], topk: int | None = None) -> list[list[Any]]: ...

    async def ready(self) -> bool: ...


@dataclass
class SearchOutcome:
    docs: Sequence[Any] = field(default_factory=list)  # retriever.client.SearchHit
    attempts: int = 0
    latency_s: float = 0.0
    error: str = ""


def _is_retryable(exc: BaseException) -> bool:
    # Bad requests (4xx other than 429) fail the same way every time; everything else
    # (timeouts, refused connections, 5xx, 429) may be a restarting or overloaded retriever.
    return not isinstance(exc, RetrieverBadRequest)


class SearchTool:
    def __init__(self, client: SearchClient, cfg: SearchConfig) -> None:
        self.client = client
        self.cfg = cfg
        self._sem = asyncio.Semaphore(cfg.max_concurrency)
        self._outage_logged = False
        self._failures_in_a_row = 0
        self._down = False  # the open breaker's cause is a failing /ready (an outage)
        self._closed = asyncio.Event()  # set: the breaker is closed (searches go through)
        self._closed.set()
        self._prober: asyncio.Task[None] | None = None
        self._ready_probe: asyncio.Future[bool] | None = None  # the /ready call in flight

    @property
    def breaker_open(self) -> bool:
        return not self._closed.is_set()

    def _record(self, failed: bool) -> None:
        if not failed:
            self._failures_in_a_row = 0
            return
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= self.cfg.breaker_failures:
            self._open(f"{self._failures_in_a_row} searches failed in a row", down=False)

    def _open(self, reason: str, *, down: bool) -> None:
        self._down = self._down or down
        if self.breaker_open:
            return
        self._closed.clear()
        metrics.RETRIEVER_BREAKER_OPEN.set(1)
        log.warning(
            "retriever circuit breaker open: searches wait for the retriever",
            extra={"reason": reason},
        )
        self._prober = asyncio.create_task(self._probe_until_ready())

    async def _ready(self) -> bool:
        """The retriever's /ready. Searches whose retries run out together (an outage) share
        the probe in flight instead of sending one each."""
        if self._ready_probe is None or self._ready_probe.done():
            self._ready_probe = asyncio.ensure_future(self._probe_ready())
        # shielded: one waiter cancelled (its rollout stopped) does not cancel the others' probe
        return await asyncio.shield(self._ready_probe)

    async def _probe_ready(self) -> bool:
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                return await self.client.ready()
        except Exception:
            return False

    async def _probe_until_ready(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.breaker_probe_s)
            if await self._ready():
                break
        self._failures_in_a_row = 0
        self._down = False
        self._closed.set()
        metrics.RETRIEVER_BREAKER_OPEN.set(0)
        log.info("retriever circuit breaker closed: the retriever answers again")

    async def _wait_closed(self, deadline: float) -> bool:
        """Wait for the breaker to close until `deadline` (monotonic); False if it did not."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._closed.wait()
            return True
        except TimeoutError:
            return False

    async def _attempts(self, query: str, outcome: SearchOutcome) -> Exception | None:
        """One search with its retries; the error that exhausted them, or None."""

        def before_sleep(state: RetryCallState) -> None:
            metrics.SEARCH_RETRIES.inc()

        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(_is_retryable),
                stop=stop_after_attempt(self.cfg.max_attempts),
                wait=wait_exponential_jitter(
                    multiplier=self.cfg.backoff_initial_s,
                    max=self.cfg.backoff_max_s,
                    jitter=self.cfg.backoff_initial_s,
                ),
                before_sleep=before_sleep,
                reraise=True,
            ):
                with attempt:
                    outcome.attempts += 1
                    async with self._sem:
                        async with asyncio.timeout(self.cfg.timeout_s):
                            result = await self.client.search([query], self.cfg.topk)
                    outcome.docs = result[0]
        except Exception as e:
            return e
        return None

    async def search(self, query: str) -> SearchOutcome:
        start = time.perf_counter()
        outcome = SearchOutcome()
        loop = asyncio.get_running_loop()
        deadline: float | None = None  # set when this search first waits for the breaker
        error: Exception | None = None
        while True:
            if self.breaker_open:
                deadline = deadline or loop.time() + self.cfg.breaker_max_wait_s
                if not await self._wait_closed(deadline):
                    outcome.docs = []
                    outcome.error = f"retriever down for more than {self.cfg.breaker_max_wait_s}s"
                    if error is not None:
                        outcome.error += f" ({self._describe(error)})"
                    metrics.SEARCH_FAILURES.labels("CircuitOpen").inc()
                    break
            error = await self._attempts(query, outcome)
            if error is None:
                self._outage_logged = False
                self._record(failed=False)
                break
            if not _is_retryable(error):  # a bad request (4xx) is the query's fault
                self._fail(outcome, error)
                break
            # Exhausted retries: an outage if /ready fails too. Then this search waits for
            # the retriever like a new one instead of becoming a failure observation.
            down = self._down or not await self._ready()
            if down:
                self._open("a search's retries ran out and /ready fails", down=True)
            self._record(failed=True)
            if not down or (deadline is not None and loop.time() >= deadline):
                self._fail(outcome, error)
                break
            metrics.SEARCH_RETRIES.inc()
        outcome.latency_s = time.perf_counter() - start
        metrics.SEARCH_LATENCY.observe(outcome.latency_s)
        return outcome

    def _describe(self, e: Exception) -> str:
        if isinstance(e, TimeoutError):
            return f"timed out after {self.cfg.timeout_s}s"
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    def _fail(self, outcome: SearchOutcome, e: Exception) -> None:
        outcome.docs = []
        outcome.error = self._describe(e)
        metrics.SEARCH_FAILURES.labels(type(e).__name__).inc()
        if not self._outage_logged:  # once per outage, not once per sample
            self._outage_logged = True
            log.warning(
                "search failed after retries",
                extra={"attempts": outcome.attempts, "error": outcome.error},
            )
