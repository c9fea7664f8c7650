"""A named lease in Redis: at most one holder at a time, kept alive by renewal.

`acquire()` takes the key with `SET NX PX` (waiting up to `wait_s` for a holder that died to
expire) and `keep()` renews it every third of its TTL with a compare-and-extend script, so a
holder that lost it (paused past the TTL, partitioned) finds out at its next renewal instead of
extending someone else's lease. A renewal that meets a Redis blip is retried at once through
the shared policy (`searchr1.redis_retry`), until the lease would have expired: waiting a third
of the TTL between tries, two Redis restarts in a row cost the trainer its lease (bench/chaos.py).
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
    def __init__(self, redis: Any, key: str, *, ttl_s: float = 15.0) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.redis, self.key, self.ttl_s = redis, key, ttl_s
        self._retry = RedisRetry("lease", ttl_s)
        self._retry.declare(["renew"])  # its retry counter exported at 0 from start-up
        self.token = secrets.token_hex(16)
        self.value = json.dumps(
            {"token": self.token, "host": socket.gethostname(), "pid": os.getpid()}
        )
        self.valid_until = 0.0  # monotonic; see check()

    async def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lease, waiting up to `wait_s` for the current holder's to expire."""
        deadline = time.monotonic() + wait_s
        while True:
            sent = time.monotonic()
            if await self.redis.set(self.key, self.value, nx=True, px=int(self.ttl_s * 1000)):
                self.valid_until = sent + self.ttl_s
                return
            if time.monotonic() >= deadline:
                raw = await self.redis.get(self.key)
                holder = json.loads(raw) if raw else {}
                raise LeaseHeld(
                    f"{self.key} is held by {holder.get('host')} pid {holder.get('pid')} "
                    f"(expires within {self.ttl_s}s of its last renewal)"
                )
            await asyncio.sleep(min(0.5, self.ttl_s / 3))

    async def renew(self) -> bool:
        ms = int(self.ttl_s * 1000)
        return bool(await self.redis.eval(_EXTEND, 1, self.key, self.token, ms))

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
