"""Both JSON transports answer alike, and fail with the same httpx exception types, so the
engine and retriever clients classify failures one way whichever they were given."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from engine_client.client import InferenceClient, InferenceUnavailable
from retriever.client import RetrieverClient, RetrieverUnavailable
from searchr1.json_http import AiohttpJson, HttpxJson, JsonTransport, dumps, loads
from searchr1.redis_server import free_port
from searchr1.sections import HttpConfig
from searchr1.service import uvicorn_server


def app() -> FastAPI:
    api = FastAPI()

    @api.post("/echo")
    async def echo(request: Request) -> Response:
        return Response(await request.body(), media_type="application/json")

    @api.get("/status/{code}")
    async def status(code: int) -> Response:
        return Response(json.dumps({"detail": f"status {code}"}), status_code=code)

    @api.get("/slow")
    async def slow() -> Response:
        await asyncio.sleep(2)
        return Response("{}")

    return api


@pytest.fixture
async def url() -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn_server(app(), HttpConfig(port=port))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task


def transports(url: str) -> list[JsonTransport]:
    return [AiohttpJson(url, max_connections=4), HttpxJson(httpx.AsyncClient(base_url=url))]


def test_codec_matches_the_json_module() -> None:
    rng = random.Random(0)
    body = {
        "input_ids": [rng.randrange(150_000) for _ in range(500)],
        "text": 'héllo 日本 🙂 "quoted" \\ \n',
        "logprobs": [[-rng.random() * 10 ** rng.randint(-8, 2), i, None] for i in range(500)],
    }
    assert loads(dumps(body)) == body == json.loads(dumps(body))
    assert loads(json.dumps(body)) == json.loads(json.dumps(body))
    with pytest.raises(ValueError):
        loads(b"not json")


async def test_both_transports_answer_alike(url: str) -> None:
    body = dumps({"input_ids": list(range(3000)), "sampling_params": {"temperature": 1.0}})
    for http in transports(url):
        try:
            reply = await http.request("POST", "/echo", body, timeout_s=5, connect_s=5)
            assert (reply.status, reply.content) == (200, body)
            teapot = await http.request("GET", "/status/418", None, timeout_s=5, connect_s=5)
            assert teapot.status == 418 and teapot.json() == {"detail": "status 418"}
        finally:
            await http.aclose()


async def test_both_transports_fail_with_httpx_exceptions(url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    for http in transports(dead):
        with pytest.raises(httpx.TransportError):
            await http.request("GET", "/x", None, timeout_s=2, connect_s=2)
        await http.aclose()
    for http in transports(url):
        with pytest.raises(httpx.TimeoutException):
            await http.request("GET", "/slow", None, timeout_s=0.2, connect_s=1)
        await http.aclose()


async def test_clients_on_aiohttp_classify_failures(url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    engine = InferenceClient(dead, max_retries=1, backoff_s=0.01, http_backend="aiohttp")
    with pytest.raises(InferenceUnavailable):
        await engine.get_model_info()
    await engine.aclose()
    retriever = RetrieverClient(dead, timeout_s=1, http_backend="aiohttp")
    assert not await retriever.health()
    with pytest.raises(RetrieverUnavailable):
        await retriever.search(["q"])
    await retriever.aclose()
