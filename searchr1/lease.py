"""A named lease in Redis: at most one holder at a time, kept alive by renewal.

`acquire()` takes the key with `SET NX PX` (waiting up to `wait_s` for a holder that died to
expire) and `keep()` renews it every third of its TTL with a compare-and-extend script, so a
holder that lost it (paused past the TTL, partitioned) finds out at its next renewal instead of
extending someone else's lease. The token is random per holder; `holder` (host, pid) is stored
beside it for the error message of whoever is refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from typing import Any

log = logging.getLogger(__name__)

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
        self.token = secrets.token_hex(16)
        self.value = json.dumps(
            {"token": self.token, "host": socket.gethostname(), "pid": os.getpid()}
        )

    async def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lease, waiting up to `wait_s` for the current holder's to expire."""
        deadline = time.monotonic() + wait_s
        while True:
            if await self.redis.set(self.key, self.value, nx=True, px=int(self.ttl_s * 1000)):
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
        A failed renewal call (Redis blip) is retried until the TTL would have run out."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                ok = await self.renew()
            except Exception as e:
                if time.monotonic() - last < self.ttl_s:
                    log.warning("lease renewal failed; retrying", extra={"error": repr(e)})
                    continue
                raise LeaseLost(f"{self.key}: not renewed for {self.ttl_s}s ({e!r})") from e
            if not ok:
                raise LeaseLost(f"{self.key}: taken over or expired")
            last = time.monotonic()

    async def release(self) -> None:
        await self.redis.eval(_RELEASE, 1, self.key, self.token)
