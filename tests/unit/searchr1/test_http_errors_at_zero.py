"""searchr1_http_unhandled_errors_total is exported at 0 for every route of a service, so the
dashboard's panel shows 0 on a healthy run instead of "No data" until the first 500."""

from __future__ import annotations

import httpx

from tests.unit.test_fault_counters_at_zero import exported


async def test_http_unhandled_errors_per_route() -> None:
    from searchr1.service import create_service_app

    app = create_service_app("zero-test")

    @app.get("/things/{name}")
    async def thing(name: str) -> dict[str, str]:
        return {"name": name}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        text = (await client.get("/metrics")).text
    assert (
        'searchr1_http_unhandled_errors_total{route="/things/{name}",service="zero-test"} 0.0'
        in (text)
    )
    assert (
        exported("searchr1_http_unhandled_errors_total", service="zero-test", route="/health")
        == 0.0
    )
