"""HTTP status mapping of the retriever app, in-process (the engine is given, no index)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from pydantic import SecretStr

from retriever.backends.base import BackendUnavailable
from retriever.config import RetrieverConfig
from retriever.engine import RetrieverEngine
from retriever.server import Serving, create_app


class GatedBackend:
    """Blocks every batch until `gate` is set; raises BackendUnavailable for 'down'."""

    name = "gated"

    def __init__(self) -> None:
        import threading

        self.gate = threading.Event()

    def search_batch(self, queries, topk):
        self.gate.wait(5)
        if "down" in queries:
            raise BackendUnavailable("backend is down")
        return [[({"id": q, "contents": q}, 1.0)] for q in queries]

    def close(self) -> None:
        pass


@pytest.fixture
async def app_and_backend():
    backend = GatedBackend()
    cfg = RetrieverConfig.model_validate({"batching": {"max_pending": 2}, "grpc_port": None})
    engine = RetrieverEngine(backend, cfg)
    app = create_app(cfg, Serving(engine=engine), admin_token=SecretStr("tok"))
    yield app, backend
    backend.gate.set()
    await engine.aclose()


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_overload_is_429_and_backend_failure_is_503(app_and_backend):
    app, backend = app_and_backend
    async with client(app) as c:
        first = asyncio.create_task(c.post("/retrieve", json={"queries": ["a"]}))
        await asyncio.sleep(0.1)  # "a" is in the (blocked) worker
        queued = asyncio.create_task(c.post("/retrieve", json={"queries": ["b", "c"]}))
        await asyncio.sleep(0.1)
        over = await c.post("/retrieve", json={"queries": ["d"]})
        assert over.status_code == 429
        assert "max_pending=2" in over.json()["error"]
        backend.gate.set()
        assert (await first).status_code == 200
        assert (await queued).json() == {
            "result": [[{"id": "b", "contents": "b"}], [{"id": "c", "contents": "c"}]]
        }
        down = await c.post("/retrieve", json={"queries": ["down"]})
        assert down.status_code == 503
        assert down.json()["error"] == "backend is down"


async def test_flush_cache_needs_the_admin_token(app_and_backend):
    app, backend = app_and_backend
    backend.gate.set()
    async with client(app) as c:
        await c.post("/retrieve", json={"queries": ["x"]})
        assert (await c.post("/flush_cache")).status_code == 401
        ok = await c.post("/flush_cache", headers={"Authorization": "Bearer tok"})
        assert ok.json() == {"flushed": 1}


async def test_not_loaded_yet_is_503_and_not_ready():
    # A config whose index cannot load: the app starts, reports not ready, answers 503.
    app = create_app(RetrieverConfig(grpc_port=None))
    async with client(app) as c:
        r = await c.post("/retrieve", json={"queries": ["a"]})
        ready = await c.get("/ready")
    assert r.status_code == 503 and "loading" in r.json()["error"]
    assert ready.status_code == 503
    assert ready.json()["checks"]["index"]["detail"] == "RuntimeError: index is still loading"
