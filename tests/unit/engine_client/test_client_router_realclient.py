"""Version checks reach every engine, never one behind a router: sglang-router 0.3.2 answers
`/get_model_info` from one worker (v1 on 4 of 4 calls while `/generate` alternated between
engines at v1 and v5). Loopback servers (aiohttp) stand in for the router and two workers;
tests/integration/test_router_realclient.py runs the real router."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engine_client.client import InferenceClient, InferenceUnavailable


async def serve(app: web.Application) -> TestServer:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


def worker(version: str, seen: list[str]) -> web.Application:
    async def model_info(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response({"model_path": "m", "weight_version": version})

    app = web.Application()
    app.router.add_get("/model_info", model_info)
    return app


def router(workers: Callable[[], list[dict]], first_worker_version: str) -> web.Application:
    async def list_workers(_: web.Request) -> web.Response:
        return web.json_response({"workers": workers(), "total": len(workers())})

    async def get_model_info(_: web.Request) -> web.Response:  # one worker answers
        return web.json_response({"model_path": "m", "weight_version": first_worker_version})

    app = web.Application()
    app.router.add_get("/workers", list_workers)
    app.router.add_get("/get_model_info", get_model_info)
    return app


@pytest.fixture
async def stack() -> AsyncIterator[tuple[str, list[dict], list[str]]]:
    seen: list[str] = []
    old, new = await serve(worker("1", seen)), await serve(worker("5", seen))
    listed = [
        {"url": f"http://127.0.0.1:{new.port}", "is_healthy": True},
        {"url": f"http://127.0.0.1:{old.port}", "is_healthy": True},
    ]
    front = await serve(router(lambda: listed, "5"))
    try:
        yield f"http://127.0.0.1:{front.port}", listed, seen
    finally:
        for s in (front, old, new):
            await s.close()


async def test_behind_a_router_the_version_is_the_oldest_workers(
    stack: tuple[str, list[dict], list[str]],
) -> None:
    url, _, seen = stack
    async with InferenceClient(url, token="t0k") as c:
        info = await c.get_model_info()
        assert info["weight_version"] == 1 and info["workers_answered"] == 2
        assert await c.router_workers() != []
    assert seen == ["Bearer t0k"] * 2  # each worker asked directly, with the token


async def test_an_unhealthy_worker_is_not_asked_and_an_unreachable_one_fails(
    stack: tuple[str, list[dict], list[str]],
) -> None:
    url, listed, _ = stack
    async with InferenceClient(url, max_retries=0) as c:
        listed[1]["is_healthy"] = False  # the router does not route to it either
        assert (await c.get_model_info())["weight_version"] == 5
        listed[1]["is_healthy"] = True
        listed.append({"url": "http://127.0.0.1:9", "is_healthy": True})  # nobody there
        with pytest.raises(InferenceUnavailable, match="is sglang-router; asking its worker"):
            await c.get_model_info()
