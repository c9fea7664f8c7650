"""Partial success is failure: sglang-router answers an admin call that some (or all) of its
workers refused with `206 {"status": "partial_success", ...}`; the client used to take any 2xx
as success (`flush_cache` "succeeded" while both engines answered 401).

A real loopback HTTP server (aiohttp) answers like the router; both client transports."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engine_client.client import InferenceBadRequest, InferenceClient, InferencePartialFailure

ROUTER_206 = {
    "status": "partial_success",
    "message": "Cache flush: 0 succeeded, 2 failed",
    "workers_flushed": 0,
    "total_http_workers": 2,
    "total_workers": 2,
    "successful": [],
    "failed": [
        {"worker": "http://127.0.0.1:1001", "error": "HTTP 401 Unauthorized"},
        {"worker": "http://127.0.0.1:1002", "error": "HTTP 401 Unauthorized"},
    ],
}


@pytest.fixture
async def router_like() -> AsyncIterator[tuple[str, list[str]]]:
    calls: list[str] = []

    async def partial(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.json_response(ROUTER_206, status=206)

    async def accepted(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.json_response({"status": "ok"}, status=202)

    async def partial_200(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.json_response({**ROUTER_206, "message": "1 succeeded, 1 failed"})

    app = web.Application()
    app.router.add_post("/flush_cache", partial)
    app.router.add_post("/pause_generation", partial_200)
    app.router.add_post("/continue_generation", accepted)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}", calls
    finally:
        await server.close()


@pytest.mark.parametrize("backend", ["httpx", "aiohttp"])
async def test_a_206_partial_success_raises_with_the_routers_message(
    router_like: tuple[str, list[str]], backend: str
) -> None:
    url, calls = router_like
    async with InferenceClient(url, backoff_s=0.001, http_backend=backend) as c:  # type: ignore[arg-type]
        with pytest.raises(InferencePartialFailure) as err:
            await c.flush_cache()
    message = str(err.value)
    assert "/flush_cache: HTTP 206" in message
    assert "0 succeeded, 2 failed" in message and "HTTP 401 Unauthorized" in message
    assert "http://127.0.0.1:1001" in message
    assert isinstance(err.value, InferenceBadRequest) and err.value.status == 206
    assert calls == ["/flush_cache"]  # not retried: the call may have done part of its work


async def test_partial_success_in_a_200_body_also_raises(
    router_like: tuple[str, list[str]],
) -> None:
    url, _ = router_like
    async with InferenceClient(url) as c:
        with pytest.raises(InferencePartialFailure, match="1 succeeded, 1 failed"):
            await c.pause_generation()


async def test_another_2xx_without_partial_success_is_success(
    router_like: tuple[str, list[str]],
) -> None:
    url, _ = router_like
    async with InferenceClient(url) as c:
        await c.continue_generation()
