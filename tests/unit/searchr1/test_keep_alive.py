"""The services keep idle connections open longer than any of our clients reuses one.

uvicorn's default keep-alive (5 s) is shorter than a rollout turn: the server closed connections
that the client's pool then reused for the next turn.
"""

from __future__ import annotations

import asyncio

import httpx

from searchr1.json_http import AiohttpJson
from searchr1.redis_server import free_port
from searchr1.sections import HttpConfig
from searchr1.service import create_service_app, uvicorn_server


def test_servers_outlast_the_clients_idle_expiry() -> None:
    server = uvicorn_server(create_service_app("svc"), HttpConfig(port=0))
    keep_alive = server.config.timeout_keep_alive
    assert keep_alive == HttpConfig().keep_alive_s == 75.0
    assert keep_alive > AiohttpJson("http://x", max_connections=1).keepalive_s  # orchestrator
    assert keep_alive > httpx.Limits().keepalive_expiry  # type: ignore[operator]  # httpx default
    assert (
        uvicorn_server(
            create_service_app("svc"), HttpConfig(keep_alive_s=7)
        ).config.timeout_keep_alive
        == 7
    )


async def _idle_connection_open_after(keep_alive_s: float, idle_s: float) -> bool:
    """GET /health on one raw connection, stay idle `idle_s`, then: is it still open?"""
    port = free_port()
    server = uvicorn_server(
        create_service_app("svc"), HttpConfig(port=port, keep_alive_s=keep_alive_s)
    )
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        await asyncio.sleep(idle_s)
        try:
            closed = await asyncio.wait_for(reader.read(1), 0.05) == b""
        except TimeoutError:
            closed = False  # nothing to read and not closed: open
        writer.close()
        return not closed
    finally:
        server.should_exit = True
        await task


async def test_an_idle_connection_stays_open_for_keep_alive_s() -> None:
    assert not await _idle_connection_open_after(keep_alive_s=0.2, idle_s=0.8)
    assert await _idle_connection_open_after(keep_alive_s=5.0, idle_s=0.8)
