"""The dashboard's "HTTP errors" panel on a real Prometheus: a service that answered no 5xx
draws a 0 line, not "No data" (a 5xx series exists only once some request failed, so the
panel's plain `rate(...{status=~"5.."})` was empty for every healthy service: the Prometheus
stack test saw it whenever no readiness poll happened to meet a 503 during start-up).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from harness.prometheus_server import PROMETHEUS, PrometheusProcess
from searchr1.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "k8s" / "searchr1" / "dashboards" / "searchr1.json"

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed")


def http_errors_expr() -> str:
    panel = next(
        p for p in json.loads(DASHBOARD.read_text())["panels"] if p.get("title") == "HTTP errors"
    )
    return next(t["expr"] for t in panel["targets"] if "searchr1_http_requests_total" in t["expr"])


@pytest.fixture
def requests_total() -> Iterator[tuple[Counter, str]]:
    """searchr1_http_requests_total, as searchr1.service labels it, served on a free port."""
    registry = CollectorRegistry()
    counter = Counter(
        "searchr1_http_requests_total",
        "HTTP requests served",
        ["service", "route", "method", "status"],
        registry=registry,
    )
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield counter, f"127.0.0.1:{port}"
    finally:
        server.shutdown()
        thread.join(5)


def test_a_service_without_5xx_draws_zero_and_one_with_them_its_rate(requests_total) -> None:
    counter, target = requests_total
    ok = counter.labels("retriever", "/retrieve", "POST", "200")
    failing = counter.labels("trainer", "/ready", "GET", "503")
    counter.labels("trainer", "/ready", "GET", "200").inc()
    ok.inc(5)
    failing.inc()
    with PrometheusProcess({"searchr1": [target]}) as prom:
        # rate() needs two samples of a series: one scraped, then a second after it moved.
        failing_series = 'searchr1_http_requests_total{status="503"}'
        prom.wait_for(failing_series, bool, timeout_s=30)
        ok.inc(5)
        failing.inc()
        prom.wait_for(f"rate({failing_series}[5m]) > 0", bool, timeout_s=30)
        result = prom.query(http_errors_expr())
    lines = {(r["metric"]["service"], r["metric"]["status"]): float(r["value"][1]) for r in result}
    assert lines.keys() == {("retriever", "5xx"), ("trainer", "503")}, result
    assert lines[("retriever", "5xx")] == 0.0
    assert lines[("trainer", "503")] > 0
