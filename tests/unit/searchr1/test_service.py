"""The shared HTTP plumbing, in process (httpx ASGITransport)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from fastapi import Depends
from pydantic import BaseModel, SecretStr

from searchr1.logs import JsonFormatter
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
