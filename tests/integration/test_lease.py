"""`searchr1.lease.RedisLease` against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from searchr1.lease import LeaseHeld, LeaseLost, RedisLease


async def test_one_holder_at_a_time_and_takeover_after_expiry(redis_server) -> None:  # type: ignore[no-untyped-def]
    r = aioredis.from_url(redis_server.url)
    try:
        a = RedisLease(r, "run:lease", ttl_s=0.6)
        b = RedisLease(r, "run:lease", ttl_s=0.6)
        await a.acquire()
        with pytest.raises(LeaseHeld, match="pid"):
            await b.acquire()
        assert await a.renew()
        # a stops renewing (paused, partitioned): b takes over once it expires ...
        await b.acquire(wait_s=3.0)
        # ... and a finds out at its next renewal instead of extending b's lease.
        assert not await a.renew()
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(a.keep(), timeout=5)
        await a.release()  # not a's any more: b keeps it
        assert await b.renew()
        await b.release()
        await a.acquire()
    finally:
        await r.aclose()
