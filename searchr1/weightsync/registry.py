"""Engines that announce themselves: how a trainer and an orchestrator find engines added to a
running run (`engines.discover`).

An engine that joins (`inference.join`) announces its URL once it holds the current weights, and
renews the announcement every third of its TTL; it withdraws it when it stops. An engine that
dies without withdrawing drops out when its TTL runs out. The registry is one Redis sorted set
per run, `<bus.stream>:engines`: member the engine's URL, score the time (Redis's own clock, in
ms) its announcement expires; `live()` drops the expired ones. Like sglang-router's
`/add_worker` (slime's engines register with the router, and its trainer asks the router for
the workers), but in the Redis every service of the stack already shares, so it works with or
without a router.

Who reads it: the trainer's `WeightPusher` (its push set is `engines.urls` plus the live
announced engines, read again at every push) and the orchestrator's engine pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

REGISTRY_ERRORS = Counter(
    "searchr1_engine_registry_errors_total",
    "Engine registry calls that failed (Redis unreachable): announce, withdraw or read",
    ["call"],
)
for _call in ("announce", "withdraw", "read"):
    REGISTRY_ERRORS.labels(_call)


def registry_key(stream: str) -> str:
    """The run's registry key, beside its trajectory stream (`bus.stream`)."""
    return f"{stream}:engines"


class EngineRegistry:
    def __init__(self, client: aioredis.Redis, key: str) -> None:
        self.client = client
        self.key = key

    @classmethod
    def from_url(cls, url: str, key: str) -> EngineRegistry:
        return cls(aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5), key)

    async def _now_ms(self) -> int:
        seconds, micros = await self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def announce(self, url: str, ttl_s: float) -> None:
        expires = await self._now_ms() + int(ttl_s * 1000)
        await self.client.zadd(self.key, {url: expires})

    async def withdraw(self, url: str) -> None:
        await self.client.zrem(self.key, url)

    async def live(self) -> list[str]:
        """The URLs whose announcement has not expired, sorted (expired ones are removed)."""
        now = await self._now_ms()
        await self.client.zremrangebyscore(self.key, "-inf", now)
        urls = await self.client.zrangebyscore(self.key, now, "+inf")
        return sorted(u.decode() if isinstance(u, bytes) else str(u) for u in urls)

    async def aclose(self) -> None:
        await self.client.aclose()


async def discovered(registry: EngineRegistry | None, configured: Sequence[str]) -> list[str]:
    """`configured` followed by the live announced engines not among them. Redis unreachable:
    the configured ones only (counted, logged): a push must not fail for want of the extras."""
    urls = list(configured)
    if registry is None:
        return urls
    try:
        extra = await registry.live()
    except (RedisError, OSError) as e:
        REGISTRY_ERRORS.labels("read").inc()
        log.warning("engine registry unreadable", extra={"error": str(e)})
        return urls
    return urls + [u for u in extra if u not in urls]


class Announcement:
    """An engine's announcement, renewed until `stop()` withdraws it."""

    def __init__(self, registry: EngineRegistry, url: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.registry = registry
        self.url = url
        self.ttl_s = ttl_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Announce now (raises if Redis is unreachable), then keep renewing."""
        await self.registry.announce(self.url, self.ttl_s)
        log.info("engine announced", extra={"url": self.url, "key": self.registry.key})
        self._task = asyncio.create_task(self._renew(), name="engine-announcement")

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self.registry.announce(self.url, self.ttl_s)
            except (RedisError, OSError) as e:
                REGISTRY_ERRORS.labels("announce").inc()
                log.warning("engine announcement not renewed", extra={"error": str(e)})

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await self.registry.withdraw(self.url)
            log.info("engine withdrawn", extra={"url": self.url})
        except (RedisError, OSError) as e:
            REGISTRY_ERRORS.labels("withdraw").inc()
            log.warning("engine not withdrawn (its TTL ends it)", extra={"error": str(e)})
