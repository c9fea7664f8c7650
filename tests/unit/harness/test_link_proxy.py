"""The chaos link proxy (harness/link_proxy.py) against a real TCP echo server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from harness.link_proxy import LinkProxy


class Echo:
    """Echoes each chunk back; keeps what it received."""

    def __init__(self) -> None:
        self.received = b""
        self.server: asyncio.Server | None = None

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            self.received += data
            w.write(data)
            await w.drain()
        w.close()


@pytest.fixture
async def link() -> AsyncIterator[tuple[LinkProxy, Echo]]:
    echo = Echo()
    server = await asyncio.start_server(echo.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = LinkProxy(f"http://127.0.0.1:{port}").start()
    try:
        yield proxy, echo
    finally:
        proxy.stop()
        server.close()


async def round_trip(proxy: LinkProxy, payload: bytes = b"ping", timeout: float = 5.0) -> float:
    r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
    start = time.monotonic()
    w.write(payload)
    await w.drain()
    got = await asyncio.wait_for(r.readexactly(len(payload)), timeout)
    assert got == payload
    w.close()
    return time.monotonic() - start


async def test_a_clear_link_forwards_both_ways(link: tuple[LinkProxy, Echo]) -> None:
    proxy, echo = link
    assert await round_trip(proxy, b"x" * 200_000) < 2.0
    assert echo.received == b"x" * 200_000


async def test_a_slow_link_delays_each_way_then_clears(link: tuple[LinkProxy, Echo]) -> None:
    proxy, _ = link
    proxy.impair(1.0, delay_s=0.2)
    assert await round_trip(proxy) >= 0.4  # 0.2 s up, 0.2 s down
    await asyncio.sleep(1.1)
    assert await round_trip(proxy) < 0.2


async def test_a_lossy_link_resets_new_connections(link: tuple[LinkProxy, Echo]) -> None:
    proxy, echo = link
    proxy.impair(5.0, drop=1.0)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await round_trip(proxy)
    assert proxy.stats.dropped == 1 and echo.received == b""


async def test_a_lossy_link_cuts_a_connection_mid_stream(link: tuple[LinkProxy, Echo]) -> None:
    proxy, _ = link
    proxy.impair(5.0, cut=1.0)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await round_trip(proxy)
    assert proxy.stats.cut == 1


async def test_a_stalled_link_holds_bytes_then_delivers_them(link: tuple[LinkProxy, Echo]) -> None:
    proxy, echo = link
    proxy.impair(1.0, stall="both")
    took = await round_trip(proxy)
    assert took >= 0.9, took  # nothing moved while stalled, nothing was lost
    assert echo.received == b"ping"


async def test_a_one_way_stall_lets_requests_through_and_holds_answers(
    link: tuple[LinkProxy, Echo],
) -> None:
    proxy, echo = link
    proxy.impair(1.0, stall="down")
    r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
    w.write(b"one-way")
    await w.drain()
    await asyncio.sleep(0.4)
    assert echo.received == b"one-way"  # the request crossed
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(r.readexactly(7), 0.2)  # its answer did not
    assert await asyncio.wait_for(r.readexactly(7), 2.0) == b"one-way"  # after the stall
    w.close()


def test_a_half_open_connection_to_a_frozen_upstream_is_kept_not_garbage_collected() -> None:
    # A client gone (an orchestrator killed) while its upstream reads nothing (a frozen engine):
    # asyncio's server drops its reference to the connection's task when the client's side is
    # lost, so the proxy's tasks were garbage collected while pending, logging "Task was
    # destroyed but it is pending!" (10 such lines in a 30-fault chaos run) and closing the
    # upstream's socket from the collector. The proxy keeps them until they end.
    import gc
    import socket

    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen(8)  # accepted by the kernel, never read: a SIGSTOPped server
    link = LinkProxy(f"127.0.0.1:{upstream.getsockname()[1]}").start()
    destroyed: list[str] = []
    link._loop.set_exception_handler(lambda loop, ctx: destroyed.append(ctx["message"]))
    try:
        for _ in range(3):
            client = socket.create_connection(("127.0.0.1", link.port))
            client.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                for _ in range(200):  # until every buffer on the way is full
                    client.send(b"x" * 65536)
            client.close()  # FIN: the proxy's client side is lost
        time.sleep(1.0)
        for _ in range(3):
            gc.collect()
            time.sleep(0.2)
        assert destroyed == []
        assert link.open_connections == 3
    finally:
        link.stop()
        upstream.close()
    assert link.open_connections == 0
