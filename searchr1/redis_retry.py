"""One retry policy for every Redis call of the stack: the bus, the orchestrator's resume state,
the trainer (through the bus), the trainer's lease (taking it at start-up, renewing it).

A call that fails because Redis is unreachable (connection refused or reset, timeout, the
server still loading its AOF after a restart) is retried with exponential backoff and jitter
until a total deadline (`bus.reconnect_timeout_s`), then `RedisUnavailable` is raised with the
last error as its cause: a blip is waited out, an outage is an error, never swallowed. Other
errors (a wrong command, a script error) are raised at once. A frozen Redis (SIGSTOP: a long
fork, a stalled VM) accepts connections and answers nothing, and a silent network cut answers
nothing either: the socket timeout (`bus.socket_timeout_s`, 5 s) ends each try, so a process
started or restarted meanwhile waits for it like any other outage, rather than exiting before
it is ready (issue 46). A call thus returns or fails within `reconnect_timeout_s` plus one
try; connections also carry TCP keepalive and TCP_USER_TIMEOUT (`bus.tcp_timeout_s`,
`searchr1.sockets`), so the kernel drops one that a cut left dead.

Retries are counted in `searchr1_redis_retries_total{component,op}` and logged once per outage
(when the first call starts retrying, and again when Redis answers), not once per attempt.

A retried write may have been applied before its reply was lost; callers retry only writes
whose repetition is harmless (SET, SADD, XACK...) or that are deduplicated downstream (a
republished trajectory is consumed once, see `searchr1.bus`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_before_delay,
    wait_exponential_jitter,
)

from searchr1.sockets import keepalive_options

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRIES = Counter(
    "searchr1_redis_retries_total",
    "Redis calls retried because Redis was unreachable",
    ["component", "op"],
)

# OSError: socket errors redis-py does not wrap (a DNS failure while a pod restarts).
RETRYABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    OSError,
)


class RedisUnavailable(RuntimeError):
    """Redis stayed unreachable past the retry deadline."""


def raise_swallowed_cancel(task: asyncio.Task[object] | None, cancels_before: int) -> None:
    """Raise CancelledError if `task` was cancelled since it had `cancels_before` requests.

    redis-py (8.1) sends and reads under `asyncio.wait_for`, which on Python 3.11 returns the
    result when a cancel lands as the socket operation completes (3.12's does not): the command
    then returns normally, or raises what the reply says, and the cancel is lost. A SIGTERM'd
    orchestrator step went on claiming groups (tests/unit/searchr1/test_redis_retry_cancel.py,
    tests/unit/orchestrator/test_partition.py). A cleanup running after a cancel started with
    the count already up, and is not cancelled again."""
    if task is not None and task.cancelling() > cancels_before:
        raise asyncio.CancelledError


def _cancels(task: asyncio.Task[object] | None) -> int:
    return task.cancelling() if task is not None else 0


class CancellableRedis(aioredis.Redis):
    """The asyncio client, with a swallowed cancellation raised after each command."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        task = asyncio.current_task()
        before = _cancels(task)
        try:
            return await super().execute_command(*args, **options)
        finally:  # an error reply too (a script's NOSCRIPT, retried with the cancel lost)
            raise_swallowed_cancel(task, before)


def connect(
    url: str,
    *,
    max_connections: int = 256,
    pool_timeout_s: float = 30.0,
    socket_timeout_s: float = 5.0,
    tcp_timeout_s: float = 30.0,
    **kwargs: object,
) -> aioredis.Redis:
    """An asyncio client whose own retries are off: `RedisRetry` is the only policy, so a
    deadline means what it says (redis-py's default retries would add their own waits).

    Every reply is due within `socket_timeout_s` (a command that blocks on purpose must block
    for less: `TrajectoryBus` slices its XREADGROUP BLOCK); `tcp_timeout_s` bounds a silent
    peer at the TCP level (`searchr1.sockets`). Its pool makes a call wait (up to
    `pool_timeout_s`) for a free connection when `max_connections` are in use: redis-py's
    default pool raised MaxConnectionsError at once, which `RedisRetry` took for an outage
    under mere load."""
    kwargs.setdefault("socket_connect_timeout", 2.0)
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        retry=Retry(NoBackoff(), 0),
        socket_timeout=socket_timeout_s,
        socket_keepalive=True,
        socket_keepalive_options=keepalive_options(tcp_timeout_s),
        **kwargs,
    )
    return CancellableRedis.from_pool(pool)


class RedisRetry:
    """The retry policy of one component (`bus`, `orchestrator`...); share one instance per
    component so an outage is logged once, however many calls wait it out."""

    def __init__(
        self,
        component: str,
        deadline_s: float,
        *,
        initial_wait_s: float = 0.05,
        max_wait_s: float = 2.0,
        error: type[RedisUnavailable] = RedisUnavailable,
    ) -> None:
        if deadline_s <= 0:
            raise ValueError("deadline_s must be > 0")
        self.component = component
        self.deadline_s = deadline_s
        self.initial_wait_s = initial_wait_s
        self.max_wait_s = max_wait_s
        self.error = error
        self._outage_since: float | None = None

    def declare(self, ops: Iterable[str]) -> None:
        """Export this component's retry counter at 0 for each of `ops` (the calls it makes):
        a dashboard's rate() then shows 0 on a healthy run, not "No data"."""
        for op in ops:
            RETRIES.labels(self.component, op)

    async def call(
        self, op: str, fn: Callable[[], Awaitable[T]], *, deadline_s: float | None = None
    ) -> T:
        """`await fn()`, retried while Redis is unreachable, for at most `deadline_s` (this
        call's own, e.g. what is left of a lease; the policy's by default)."""
        deadline_s = self.deadline_s if deadline_s is None else deadline_s

        def before_sleep(state: RetryCallState) -> None:
            RETRIES.labels(self.component, op).inc()
            if self._outage_since is None:
                self._outage_since = time.monotonic()
                exc = state.outcome.exception() if state.outcome else None
                log.warning(
                    "redis unreachable; retrying",
                    extra={
                        "component": self.component,
                        "op": op,
                        "error": repr(exc),
                        "deadline_s": deadline_s,
                    },
                )

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(RETRYABLE),
            wait=wait_exponential_jitter(
                multiplier=self.initial_wait_s, max=self.max_wait_s, jitter=self.initial_wait_s
            ),
            # Stops before a wait that would end past the deadline: the total stays bounded.
            stop=stop_before_delay(deadline_s),
            before_sleep=before_sleep,
            reraise=True,
        )
        task = asyncio.current_task()
        cancels_before = _cancels(task)
        try:
            async for attempt in retrying:
                with attempt:
                    try:
                        result = await fn()
                    finally:  # pipelines too; an error would be retried with the cancel lost
                        raise_swallowed_cancel(task, cancels_before)
        except RETRYABLE as e:
            self._outage_since = None  # the next outage is logged again
            raise self.error(
                f"redis unreachable for {deadline_s}s during {self.component}.{op}: {e!r}"
            ) from e
        if self._outage_since is not None:
            log.warning(
                "redis reachable again",
                extra={
                    "component": self.component,
                    "op": op,
                    "outage_s": round(time.monotonic() - self._outage_since, 3),
                },
            )
            self._outage_since = None
        return result
