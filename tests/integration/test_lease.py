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


async def test_acks_are_fenced_by_the_lease_token(redis_server) -> None:  # type: ignore[no-untyped-def]
    """A trainer that lost its lease (paused past the TTL) must not ack work it trained: the
    new holder trains it again. Redis itself rejects the late ack, not the old trainer."""
    from searchr1.bus import Fenced, TrajectoryBus
    from searchr1.sections import BusConfig
    from tests.factories import make_trajectory

    publisher = TrajectoryBus.from_url(redis_server.url, BusConfig())
    old = TrajectoryBus.from_url(redis_server.url, BusConfig(consumer="old"))
    try:
        await publisher.publish([make_trajectory("t-0"), make_trajectory("t-1")])
        got = await old.consume(10, block=0.5)
        assert len(got) == 2
        lease = RedisLease(old.redis, f"{old.stream}:trainer-lease", ttl_s=0.3)
        await lease.acquire()
        old.fence_with(lease.key, lease.token)
        await asyncio.sleep(0.5)  # paused past its TTL ...
        newer = RedisLease(old.redis, lease.key, ttl_s=5)
        await newer.acquire()  # ... and another trainer took over
        with pytest.raises(Fenced, match="lease"):
            await old.ack(got)
        assert await publisher.pending_count() == 2  # nothing acked: the new holder gets them
        assert await publisher.backlog() == 2
        old.fence_with(newer.key, newer.token)  # the holder's acks go through
        assert await old.ack(got) == 2
        assert await publisher.backlog() == 0
    finally:
        await publisher.close()
        await old.close()


async def test_an_ack_held_by_a_partition_is_fenced_once_another_trainer_holds_the_lease(
    redis_server,  # type: ignore[no-untyped-def]
) -> None:
    """Issue 32's split brain across a partition: the old trainer's link to Redis partitioned
    (both ways, its connections open and silent: harness/link_proxy.py) as it acks; its lease
    expires and a new trainer takes over; then the link heals and the held ack reaches Redis,
    late. Redis refuses it: never two trainers acking at once."""
    from harness.link_proxy import LinkProxy
    from searchr1.bus import Fenced, TrajectoryBus
    from searchr1.sections import BusConfig
    from tests.factories import make_trajectory

    link = LinkProxy(redis_server.url).start()
    publisher = TrajectoryBus.from_url(redis_server.url, BusConfig())
    old = TrajectoryBus.from_url(f"redis://127.0.0.1:{link.port}", BusConfig(consumer="old"))
    new_r = aioredis.from_url(redis_server.url)
    try:
        await publisher.publish([make_trajectory("t-0"), make_trajectory("t-1")])
        got = await old.consume(10, block=0.5)
        lease = RedisLease(old.redis, f"{old.stream}:trainer-lease", ttl_s=0.5)
        await lease.acquire()
        old.fence_with(lease.key, lease.token)
        link.impair(2.0, stall="both")  # the partition, as the old trainer acks
        ack = asyncio.create_task(old.ack(got))
        newer = RedisLease(new_r, lease.key, ttl_s=30)
        await newer.acquire(wait_s=5.0)  # the old lease expired: another trainer holds it
        with pytest.raises(Fenced, match="lease"):
            await asyncio.wait_for(ack, 30)  # delivered once the link heals, and refused
        assert await publisher.pending_count() == 2  # the new holder gets them
        assert link.stats.chunks > 0  # the ack did cross the healed link
    finally:
        await publisher.close()
        await old.close()
        await new_r.aclose()
        link.stop()


async def test_the_lease_outlives_redis_restarts_between_renewals(redis_server) -> None:  # type: ignore[no-untyped-def]
    """bench/chaos.py: Redis killed twice within one TTL, and each time a renewal fell in the
    second it was down. A failed renewal was tried again only a third of the TTL later: the
    lease expired and the trainer stopped. Now a renewal retries at once."""
    from searchr1.redis_retry import connect

    restarts: list[asyncio.Task[None]] = []

    async def start_later() -> None:
        await asyncio.sleep(0.3)
        await asyncio.to_thread(redis_server.start)

    class Blips(RedisLease):
        renewals = 0

        async def renew(self) -> bool:
            self.renewals += 1
            if self.renewals <= 2:  # Redis crashes now and is back 0.3 s later
                redis_server.stop(kill=True)
                restarts.append(asyncio.create_task(start_later()))
            return await super().renew()

    r = connect(redis_server.url)
    try:
        lease = Blips(r, "run:lease", ttl_s=1.5)
        await lease.acquire()
        keeper = asyncio.create_task(lease.keep())
        await asyncio.sleep(3 * lease.ttl_s)
        await asyncio.gather(*restarts)
        assert not keeper.done(), keeper.exception()
        assert lease.renewals > 4 and await lease.renew()  # still ours
        keeper.cancel()
    finally:
        await r.aclose()
