"""The HTTP clients' sockets carry the same TCP bound as the Redis ones (issue 46 item 6).

A network cut that drops packets leaves a connection open and silent: without keepalive and
TCP_USER_TIMEOUT a call to an engine or the retriever across it waits for the kernel's
retransmission backoff after the heal (up to two minutes between tries) or for its own read
timeout (the engine's is 600 s: a generation may be long). With them the kernel ends such a
connection within `tcp_timeout_s` and the client's own retry connects again once the cut heals.
A slow or frozen peer is not cut off: its kernel still answers the probes and acknowledges data.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Response

from engine_client.client import InferenceClient
from retriever.client import RetrieverClient
from searchr1.json_http import AiohttpJson, HttpxJson, httpx_client
from searchr1.redis_server import free_port
from searchr1.sections import HttpConfig
from searchr1.service import uvicorn_server
from searchr1.sockets import HTTP_TCP_TIMEOUT_S, socket_options


@pytest.fixture
async def url() -> AsyncIterator[str]:
    api = FastAPI()

    @api.get("/ok")
    async def ok() -> Response:
        return Response("{}", media_type="application/json")

    port = free_port()
    server = uvicorn_server(api, HttpConfig(port=port))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task


def _bound(sock: socket.socket) -> tuple[int, int, int]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
    )


def _aiohttp_sockets(http: AiohttpJson) -> list[socket.socket]:
    """The idle pooled connections' sockets (aiohttp's connector keeps them by key)."""
    conns: dict[Any, Any] = http._session.connector._conns  # type: ignore[union-attr]
    return [proto.transport.get_extra_info("socket") for q in conns.values() for proto, _ in q]


async def _httpx_sockets(http: HttpxJson) -> list[socket.socket]:
    pool = http.client._transport._pool  # type: ignore[attr-defined]
    return [c._connection._network_stream.get_extra_info("socket") for c in pool.connections]


def test_the_options_bound_a_silent_peer() -> None:
    opts = {(level, opt): value for level, opt, value in socket_options(12.0)}
    assert opts[(socket.SOL_SOCKET, socket.SO_KEEPALIVE)] == 1
    assert opts[(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)] == 12_000
    idle = opts[(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)]
    interval = opts[(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)]
    assert idle + interval * opts[(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)] <= 12
    with pytest.raises(ValueError, match="tcp_timeout_s"):
        socket_options(0.5)


async def test_aiohttp_connections_carry_the_bound(url: str) -> None:
    http = AiohttpJson(url, max_connections=2, tcp_timeout_s=12.0)
    try:
        assert (await http.request("GET", "/ok", None, timeout_s=5, connect_s=5)).status == 200
        socks = _aiohttp_sockets(http)
        assert socks and all(_bound(s) == (1, 12_000, 6) for s in socks)
    finally:
        await http.aclose()


async def test_httpx_connections_carry_the_bound(url: str) -> None:
    http = HttpxJson(httpx_client(url, max_connections=2, tcp_timeout_s=12.0))
    try:
        assert (await http.request("GET", "/ok", None, timeout_s=5, connect_s=5)).status == 200
        socks = await _httpx_sockets(http)
        assert socks and all(_bound(s) == (1, 12_000, 6) for s in socks)
    finally:
        await http.aclose()


async def test_the_engine_and_retriever_clients_carry_the_default_bound(url: str) -> None:
    bound = (1, int(HTTP_TCP_TIMEOUT_S * 1000), int(HTTP_TCP_TIMEOUT_S / 2))
    for backend in ("httpx", "aiohttp"):
        engine = InferenceClient(url, http_backend=backend)  # type: ignore[arg-type]
        retriever = RetrieverClient(url, http_backend=backend)  # type: ignore[arg-type]
        for http in (engine._http, retriever._client):
            try:
                reply = await http.request("GET", "/ok", None, timeout_s=5, connect_s=5)
                assert reply.status == 200
                socks = (
                    _aiohttp_sockets(http)
                    if isinstance(http, AiohttpJson)
                    else await _httpx_sockets(http)  # type: ignore[arg-type]
                )
                assert socks and all(_bound(s) == bound for s in socks), backend
            finally:
                await http.aclose()
