"""Hostile input that is not JSON at all: `{"topk": NaN}` / `Infinity` (Python's JSON parser,
which Starlette uses, accepts them). The 422 handler used to echo the non-finite value, the
answer's JSON rendering failed and the client got a 500; now a 422 naming the field, fixed once
in `searchr1.service` for every service (the retriever's and the engine's real apps here)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, SecretStr

from retriever.config import RetrieverConfig
from retriever.engine import RetrieverEngine
from retriever.server import Serving, create_app
from searchr1.service import create_service_app

HOSTILE = ["NaN", "Infinity", "-Infinity", "1e999"]


class EchoBackend:
    name = "echo"

    def search_batch(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        return [[({"id": q, "contents": q}, 1.0)] for q in queries]

    def close(self) -> None:
        pass


async def post_raw(app: FastAPI, path: str, body: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.post(path, content=body, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("value", HOSTILE)
async def test_the_retriever_answers_a_non_finite_topk_with_422(value: str) -> None:
    cfg = RetrieverConfig.model_validate({"grpc_port": None})
    engine = RetrieverEngine(EchoBackend(), cfg)
    try:
        app = create_app(cfg, Serving(engine=engine), admin_token=SecretStr("tok"))
        resp = await post_raw(app, "/retrieve", f'{{"queries": ["a"], "topk": {value}}}')
    finally:
        await engine.aclose()
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"].startswith("topk: ")


class Body(BaseModel):
    n: int
    x: list[int]


@pytest.mark.parametrize("value", HOSTILE)
async def test_any_service_echoes_non_finite_input_as_text(value: str) -> None:
    app = create_service_app("t")

    @app.post("/echo")
    async def echo(body: Body) -> dict[str, int]:
        return {"n": body.n}

    resp = await post_raw(app, "/echo", f'{{"n": {value}, "x": [1, {value}]}}')
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error.startswith("n: ") and "x.1: " in error
    assert resp.json()["detail"][0]["input"] in ("NaN", "Infinity", "-Infinity")


@pytest.mark.parametrize("value", HOSTILE)
async def test_the_engine_answers_a_non_finite_token_id_with_422(
    value: str, tiny_model_dir: Path
) -> None:
    from inference.config import TorchEngineConfig
    from inference.engine import TorchEngine
    from inference.server import create_app as create_engine_app

    engine = TorchEngine(tiny_model_dir, TorchEngineConfig())
    try:
        body = f'{{"input_ids": [1, {value}], "sampling_params": {{"max_new_tokens": 1}}}}'
        resp = await post_raw(create_engine_app(engine), "/generate", body)
    finally:
        engine.shutdown()
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"].startswith("input_ids.1: ")
