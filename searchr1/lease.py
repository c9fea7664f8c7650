"""A named lease in Redis: at most one holder at a time, kept alive by renewal.

`acquire()` takes the key when it is free (a script: `SET PX` if absent, or re-extended if it
holds this holder's own value, so a retried try whose first was applied is not refused),
waiting up to `wait_s` for a holder that died to expire, and waiting for Redis itself (frozen,
restarting, cut off) up to `redis_wait_s` through the shared retry policy. `keep()` renews it
every third of its TTL with a compare-and-extend script, so a holder that lost it (paused past
the TTL, partitioned) finds out at its next renewal instead of extending someone else's lease.
A renewal that meets a Redis blip is retried at once through the shared policy
(`searchr1.redis_retry`), until the lease would have expired: waiting a third of the TTL
between tries, two Redis restarts in a row cost the trainer its lease (bench/chaos.py).
`check()` raises LeaseLost once the holder's own clock says the lease may have expired (counted
from the send of the last SET or renewal that held, so never later than Redis's own expiry): what
the holder does that Redis cannot fence (a weight push to the engines, a checkpoint on a shared
volume) calls it first, so a holder paused past its TTL (SIGSTOP, a GC pause, a partition) does
not act on a lease another holder may own by then. The token is random per holder; `holder`
(host, pid) is stored beside it for the error message of whoever is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import time
from typing import Any

from searchr1.redis_retry import RedisRetry, RedisUnavailable

# Extend only if we still hold it: a lease that expired and was taken by another holder must
# not be extended (or deleted) by the old one.
_EXTEND = """
local v = redis.call('GET', KEYS[1])
if v and cjson.decode(v)['token'] == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# Take the lease if free, or if this holder's own value is there already: a retried SET whose
# first try was applied before its reply was lost (Redis frozen with the command in its socket
# buffer) must not find "held" and wait for its own lease to expire.
_ACQUIRE = """
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if v == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
local v = redis.call('GET', KEYS[1])
if v and cjson.decode(v)['token'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseHeld(RuntimeError):
    """Someone else holds the lease."""


class LeaseLost(RuntimeError):
    """We held the lease and no longer do."""


class RedisLease:
    def __init__(
        self, redis: Any, key: str, *, ttl_s: float = 15.0, redis_wait_s: float = 120.0
    ) -> None:
        """`redis_wait_s`: how long `acquire` waits for an unreachable Redis (frozen,
        restarting, cut off) per call: the trainer passes `bus.reconnect_timeout_s`."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.redis, self.key, self.ttl_s = redis, key, ttl_s
        self._retry = RedisRetry("lease", ttl_s)
        self._retry.declare(["renew"])  # its retry counter exported at 0 from start-up
        # A component of its own: `lease` counts renewals at risk (SearchR1TrainerLeaseLost
        # reads it); waiting for Redis before holding anything puts no lease at risk.
        self._start_retry = RedisRetry("lease_acquire", redis_wait_s)
        self._start_retry.declare(["take", "holder"])
        self.token = secrets.token_hex(16)
        self.value = json.dumps(
            {"token": self.token, "host": socket.gethostname(), "pid": os.getpid()}
        )
        self.valid_until = 0.0  # monotonic; see check()

    async def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lease, waiting up to `wait_s` for the current holder's to expire.

        A process started while Redis is frozen or unreachable waits for it (each call through
        the shared retry policy, up to `redis_wait_s`: logged once, counted, then
        RedisUnavailable naming Redis and the deadline) instead of exiting before it is ready
        (issue 46: the trainer restarted during bench/chaos.py's `freeze:redis` ended the run).
        `wait_s` counts from Redis's first answer: a wait for Redis is not a wait for a holder.
        """
        deadline: float | None = None
        sent = 0.0

        async def take() -> bool:
            nonlocal sent
            sent = time.monotonic()  # this try's: the lease counts from the SET that took it
            return bool(await self.redis.eval(_ACQUIRE, 1, self.key, self.value, self.ttl_ms))

        while True:
            if await self._start_retry.call("take", take):
                self.valid_until = sent + self.ttl_s
                return
            now = time.monotonic()
            deadline = now + wait_s if deadline is None else deadline
            if now >= deadline:
                raw = await self._start_retry.call("holder", lambda: self.redis.get(self.key))
                holder = json.loads(raw) if raw else {}
                raise LeaseHeld(
                    f"{self.key} is held by {holder.get('host')} pid {holder.get('pid')} "
                    f"(expires within {self.ttl_s}s of its last renewal)"
                )
            await asyncio.sleep(min(0.5, self.ttl_s / 3, max(deadline - now, 0.0)))

    @property
    def ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)

    async def renew(self) -> bool:
        return bool(await self.redis.eval(_EXTEND, 1, self.key, self.token, self.ttl_ms))

    async def keep(self) -> None:
        """Renew until cancelled; raises LeaseLost once the lease is someone else's (or gone).
        A renewal call that fails on a Redis blip is retried until the TTL would have run out
        (counted from the send of the last renewal that held: its extension started no later)."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            sent = time.monotonic()
            left = self.valid_until - sent
            try:
                ok = await self._retry.call("renew", self.renew, deadline_s=max(left, 0.001))
            except RedisUnavailable as e:
                raise LeaseLost(f"{self.key}: not renewed for {self.ttl_s}s ({e})") from e
            if not ok:
                raise LeaseLost(f"{self.key}: taken over or expired")
            self.valid_until = sent + self.ttl_s

    def check(self) -> None:
        """LeaseLost if the lease may have expired by now (see the module's docstring)."""
        late = time.monotonic() - self.valid_until
        if late >= 0:
            raise LeaseLost(
                f"{self.key}: not renewed for {self.ttl_s + late:.1f}s (TTL {self.ttl_s}s): "
                "another holder may own it"
            )

    async def release(self) -> None:
        await self.redis.eval(_RELEASE, 1, self.key, self.token)
