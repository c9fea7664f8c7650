"""The search tool: a global concurrency cap, a timeout per attempt, bounded retries.

An exhausted retry budget is an explicit outcome (`SearchOutcome.error`): the rollout shows the
policy a failure observation, records the error on the turn and counts it. Nothing becomes a
silent empty `<information></information>` (slime's client defect).
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

log = logging.getLogger(__name__)


class SearchClient(Protocol):
    async def search(self, queries: list[str], topk: int | None = None) -> list[list[Any]]: ...


@dataclass
class SearchOutcome:
    docs: Sequence[Any] = field(default_factory=list)  # retriever.client.SearchHit
    attempts: int = 0
    latency_s: float = 0.0
    error: str = ""


def _is_retryable(exc: BaseException) -> bool:
    # Bad requests (4xx other than 429) fail the same way every time; everything else
    # (timeouts, refused connections, 5xx, 429) may be a restarting or overloaded retriever.
    from retriever.client import RetrieverBadRequest

    return not isinstance(exc, RetrieverBadRequest)


class SearchTool:
    def __init__(self, client: SearchClient, cfg: SearchConfig) -> None:
        self.client = client
        self.cfg = cfg
        self._sem = asyncio.Semaphore(cfg.max_concurrency)
        self._outage_logged = False

    async def search(self, query: str) -> SearchOutcome:
        start = time.perf_counter()
        outcome = SearchOutcome()

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
            self._outage_logged = False
        except Exception as e:
            outcome.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if isinstance(e, TimeoutError):
                outcome.error = f"timed out after {self.cfg.timeout_s}s"
            metrics.SEARCH_FAILURES.labels(type(e).__name__).inc()
            if not self._outage_logged:  # once per outage, not once per sample
                self._outage_logged = True
                log.warning(
                    "search failed after retries",
                    extra={"attempts": outcome.attempts, "error": outcome.error},
                )
        outcome.latency_s = time.perf_counter() - start
        metrics.SEARCH_LATENCY.observe(outcome.latency_s)
        return outcome
