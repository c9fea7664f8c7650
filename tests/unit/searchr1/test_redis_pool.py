"""connect()'s client waits for a free pooled connection instead of failing: under load (more
calls in flight than the pool holds) redis-py's default pool raised MaxConnectionsError, which
RedisRetry took for an outage (bench/pipeline.py at 64 GPUs: groups went stale waiting)."""

from __future__ import annotations

import asyncio

from searchr1.redis_retry import connect


async def test_more_calls_in_flight_than_connections_all_succeed(redis_server) -> None:  # type: ignore[no-untyped-def]
    r = connect(redis_server.url, max_connections=2)
    try:
        await asyncio.gather(*(r.incr("searchr1:test:pool") for _ in range(200)))
        assert int(await r.get("searchr1:test:pool")) == 200
    finally:
        await r.aclose()
