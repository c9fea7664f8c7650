"""Bounded waits between the bus and Redis (issue 46 item 6): a blocking read longer than the
socket timeout is not an outage; a call across a silent cut (harness/link_proxy.py, both
ways stalled, connections open) returns once the cut heals, or fails within its bound."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from harness.link_proxy import LinkProxy
from searchr1.bus import BusUnavailable, TrajectoryBus
from searchr1.redis_server import RedisServer
from searchr1.sections import BusConfig
from tests.factories import make_trajectory


def retries(op: str) -> float:
    labels = {"component": "bus", "op": op}
    return REGISTRY.get_sample_value("searchr1_redis_retries_total", labels) or 0.0


async def test_a_blocking_read_longer_than_the_socket_timeout_is_not_an_outage(
    redis_server: RedisServer,
) -> None:
    # The default socket timeout (redis-py's 5 s before it was set explicitly): a consumer
    # blocking 6 s on an empty stream timed out, was retried as if Redis were down and
    # failed with BusUnavailable.
    cfg = BusConfig(reconnect_timeout_s=1.0, consumer="c")
    bus = TrajectoryBus.from_url(redis_server.url, cfg)
    before = retries("read")
    try:
        start = time.monotonic()
        assert await bus.consume(1, block=cfg.socket_timeout_s + 1.0) == []
        assert time.monotonic() - start >= cfg.socket_timeout_s + 1.0 - 0.1
        assert retries("read") == before
    finally:
        await bus.close()


def test_redis_connections_carry_the_tcp_bound() -> None:
    import socket

    from searchr1.sockets import keepalive_options

    opts = keepalive_options(30.0)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        assert opts[socket.TCP_USER_TIMEOUT] == 30_000
    idle, interval = opts[socket.TCP_KEEPIDLE], opts[socket.TCP_KEEPINTVL]
    assert idle + interval * opts[socket.TCP_KEEPCNT] <= 30


async def test_the_bus_sockets_have_keepalive_and_user_timeout(redis_server: RedisServer) -> None:
    import socket

    bus = TrajectoryBus.from_url(redis_server.url, BusConfig(tcp_timeout_s=12.0))
    try:
        await bus.backlog()
        conn = await bus.redis.connection_pool.get_connection()
        sock = conn._writer.get_extra_info("socket")  # type: ignore[union-attr]
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 12_000
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 6
        await bus.redis.connection_pool.release(conn)
    finally:
        await bus.close()


async def test_a_bus_call_across_a_cut_that_heals_returns_once_it_heals(
    redis_server: RedisServer,
) -> None:
    link = LinkProxy(redis_server.url).start()
    cfg = BusConfig(socket_timeout_s=1.0, reconnect_timeout_s=30.0)
    bus = TrajectoryBus.from_url(f"redis://127.0.0.1:{link.port}", cfg)
    try:
        await bus.publish([make_trajectory("t-before")])
        link.impair(3.0, stall="both")  # silent both ways; connections stay open
        start = time.monotonic()
        await bus.publish([make_trajectory("t-during")])
        took = time.monotonic() - start
        # Not before the heal; then within one try and one backoff wait (2 s at most).
        assert 3.0 - 0.2 <= took <= 3.0 + cfg.socket_timeout_s + 2.0 + 1.0, took
        # The timed-out try's write reaches Redis too once the cut heals (retried writes are
        # deduplicated downstream): consumed once.
        assert await bus.backlog() in (2, 3)
        assert {d.trajectory_id for d in await bus.consume(10, block=1)} == {
            "t-before",
            "t-during",
        }
    finally:
        await bus.close()
        link.stop()


async def test_a_bus_call_across_a_cut_that_lasts_fails_within_its_bound(
    redis_server: RedisServer,
) -> None:
    link = LinkProxy(redis_server.url).start()
    cfg = BusConfig(socket_timeout_s=1.0, reconnect_timeout_s=3.0)
    bus = TrajectoryBus.from_url(f"redis://127.0.0.1:{link.port}", cfg)
    try:
        await bus.backlog()
        link.impair(60.0, stall="both")
        start = time.monotonic()
        with pytest.raises(BusUnavailable, match=r"unreachable for 3\.0s during bus\.backlog"):
            await asyncio.wait_for(bus.backlog(), 60)
        took = time.monotonic() - start
        # The deadline, then the try under way: its connect and handshake and the command.
        assert cfg.reconnect_timeout_s <= took <= cfg.reconnect_timeout_s + 2.0 + 2 * 1.0, took
    finally:
        await bus.close()
        link.stop()
