"""The shared HTTP plumbing, in process (httpx ASGITransport)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from fastapi import Depends, FastAPI
from pydantic import BaseModel, SecretStr

from searchr1.logs import JsonFormatter
from searchr1.sections import HttpConfig
from searchr1.service import create_service_app, require_token


class Item(BaseModel):
    name: str
    count: int


def make_app(ready: dict[str, bool]):  # type: ignore[no-untyped-def]
    async def redis_check() -> str:
        if not ready["redis"]:
            raise ConnectionError("connection refused")
        return "pong"

    app = create_service_app("testsvc", ready_checks={"redis": redis_check})
    guard = require_token(SecretStr("tok"))

    @app.post("/items")
    async def items(item: Item) -> dict[str, int]:
        logging.getLogger("testsvc").info("item stored", extra={"item": item.name})
        return {"count": item.count}

    @app.post("/admin/flush", dependencies=[Depends(guard)])
    async def flush() -> dict[str, bool]:
        return {"flushed": True}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("kaput")

    return app


@pytest.fixture
def state() -> dict[str, bool]:
    return {"redis": True}


@pytest.fixture
async def client(state: dict[str, bool]):  # type: ignore[no-untyped-def]
    transport = httpx.ASGITransport(app=make_app(state), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as c:
        yield c


async def test_health_is_independent_of_dependencies(client, state) -> None:  # type: ignore[no-untyped-def]
    state["redis"] = False
    r = await client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "service": "testsvc"}


async def test_ready_reports_each_check(client, state) -> None:  # type: ignore[no-untyped-def]
    r = await client.get("/ready")
    assert r.status_code == 200
    assert r.json()["checks"]["redis"] == {"ok": True, "detail": "pong"}
    state["redis"] = False
    r = await client.get("/ready")
    assert r.status_code == 503
    assert r.json()["checks"]["redis"]["detail"] == "ConnectionError: connection refused"


async def test_metrics_count_requests_by_route(client) -> None:  # type: ignore[no-untyped-def]
    await client.post("/items", json={"name": "a", "count": 1})
    text = (await client.get("/metrics")).text
    assert 'searchr1_http_requests_total{method="POST",route="/items",service="testsvc"' in text
    assert "searchr1_http_request_duration_seconds_bucket" in text


async def test_request_id_is_echoed_and_logged(client) -> None:  # type: ignore[no-untyped-def]
    formatter = JsonFormatter("testsvc")
    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(formatter.format(record))

    handler = Capture()
    logger = logging.getLogger("testsvc")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        r = await client.post(
            "/items", json={"name": "a", "count": 1}, headers={"X-Request-ID": "req-42"}
        )
    finally:
        logger.removeHandler(handler)
    assert r.headers["X-Request-ID"] == "req-42"
    entry = json.loads(lines[-1])
    assert entry["request_id"] == "req-42"
    assert entry["msg"] == "item stored"
    assert entry["item"] == "a"
    assert entry["service"] == "testsvc"
    r = await client.get("/health")
    assert len(r.headers["X-Request-ID"]) == 16  # generated when absent


async def test_validation_errors_are_422_naming_the_field(client) -> None:  # type: ignore[no-untyped-def]
    r = await client.post("/items", json={"name": "a", "count": "many"})
    assert r.status_code == 422
    assert r.json()["error"].startswith("count: Input should be a valid integer")


async def test_token_guards_state_changing_endpoints(client) -> None:  # type: ignore[no-untyped-def]
    assert (await client.post("/admin/flush")).status_code == 401
    bad = await client.post("/admin/flush", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401
    ok = await client.post("/admin/flush", headers={"Authorization": "Bearer tok"})
    assert ok.status_code == 200


async def test_open_when_no_token_is_configured() -> None:
    app = create_service_app("open")

    @app.post("/admin", dependencies=[Depends(require_token(None))])
    async def admin() -> dict[str, bool]:
        return {"ok": True}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as c:
        assert (await c.post("/admin")).status_code == 200


async def test_unhandled_errors_are_500_with_request_id_and_counted(client) -> None:  # type: ignore[no-untyped-def]
    r = await client.get("/boom", headers={"X-Request-ID": "req-boom"})
    assert r.status_code == 500
    assert r.json() == {"error": "internal error", "request_id": "req-boom"}
    text = (await client.get("/metrics")).text
    assert 'searchr1_http_unhandled_errors_total{route="/boom",service="testsvc"}' in text


async def test_a_body_that_is_not_json_is_a_422_not_a_500(client) -> None:  # type: ignore[no-untyped-def]
    r = await client.post(
        "/items", content=b"\xff{not json", headers={"content-type": "text/plain"}
    )
    assert r.status_code == 422
    assert r.json()["error"]


# ---- hostile input (issue 15) ------------------------------------------------------------


def limited_app(limit: int) -> tuple[FastAPI, list[int]]:
    app = create_service_app("limited", max_body_bytes=limit)
    seen: list[int] = []

    @app.post("/echo")
    async def echo(item: dict) -> dict[str, int]:
        seen.append(len(item["blob"]))
        return {"len": len(item["blob"])}

    return app, seen


def limited_client(app: FastAPI) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://svc")


async def test_a_body_over_the_limit_is_413_naming_the_setting() -> None:
    app, seen = limited_app(1000)
    async with limited_client(app) as c:
        ok = await c.post("/echo", json={"blob": "x" * 900})
        big = await c.post("/echo", json={"blob": "x" * 2000})
        health = await c.get("/health")
    assert ok.status_code == 200
    assert big.status_code == 413
    assert "http.max_body_bytes" in big.json()["error"] and "1000" in big.json()["error"]
    assert seen == [900]  # the oversized request never reached the route
    assert health.status_code == 200


async def test_a_chunked_body_over_the_limit_is_cut_off_while_streaming() -> None:
    app, seen = limited_app(1000)
    pulled: list[int] = []

    async def chunks():  # type: ignore[no-untyped-def]
        yield b'{"blob": "'
        for i in range(100):  # 10 KB in all, no Content-Length
            pulled.append(i)
            yield b"x" * 100
        yield b'"}'

    async with limited_client(app) as c:
        r = await c.post("/echo", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert "http.max_body_bytes" in r.json()["error"]
    assert len(pulled) < 15  # stopped reading soon after the limit, not at the end
    assert seen == []


async def test_the_limit_comes_from_the_http_config() -> None:
    from searchr1.service import uvicorn_server

    app, _ = limited_app(1000)
    uvicorn_server(app, HttpConfig(max_body_bytes=50))
    async with limited_client(app) as c:
        r = await c.post("/echo", json={"blob": "x" * 100})
    assert r.status_code == 413 and "50" in r.json()["error"]


def test_http_config_default_body_limit_is_8_mib() -> None:
    assert HttpConfig().max_body_bytes == 8 * 1024 * 1024


async def test_a_422_echoing_a_lone_surrogate_is_still_a_422() -> None:
    app = make_app({"redis": True})
    async with limited_client(app) as c:
        r = await c.post(
            "/items",
            content=b'{"name": "a", "count": "\\ud800"}',
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 422, r.text
    assert r.json()["error"].startswith("count:")


def test_an_empty_token_is_refused_when_the_guard_is_built() -> None:
    for empty in ("", "   "):
        with pytest.raises(ValueError, match="empty"):
            require_token(SecretStr(empty))


async def test_an_empty_bearer_is_never_accepted(client) -> None:  # type: ignore[no-untyped-def]
    for header in ("Bearer ", "Bearer", "bearer  ", "Basic tok", "tok"):
        r = await client.post("/admin/flush", headers={"Authorization": header})
        assert r.status_code == 401, header
