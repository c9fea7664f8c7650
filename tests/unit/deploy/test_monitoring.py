"""The chart's monitoring: ServiceMonitor, PodMonitor and the Grafana dashboard ConfigMap.

Rendered offline and checked against a vendored JSON schema of the Prometheus Operator's CRD
fields (tests/unit/deploy/schemas); the monitors must select the chart's own Services and pods;
every metric and label the dashboard queries must be one the services really register.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kv

from tests.unit.deploy import stack

SCHEMAS = json.loads(
    (Path(__file__).parent / "schemas" / "monitoring.coreos.com_v1.json").read_text()
)
ALL_ON = {
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "podMonitor": {"enabled": True},
        "grafanaDashboard": {"enabled": True, "folder": "RL"},
    }
}
# Every module that registers Prometheus metrics, so the registry holds all of them.
METRIC_MODULES = [
    "retriever.engine",
    "retriever.batcher",
    "retriever.cache",
    "inference.scheduler",
    "inference.pause",
    "inference.server",
    "searchr1.weightsync.receiver",
    "engine_client.client",
    "orchestrator.metrics",
    "orchestrator.tools.search",
    "trainer.metrics",
    "searchr1.service",
    "searchr1.bus",
    "searchr1.redis_retry",
    "gateway.metrics",
]


def render(values_name: str, extra: dict[str, Any]) -> list[dict[str, Any]]:
    path = stack.VALUES_FILES[values_name]
    values = (yaml.safe_load(path.read_text()) if path else None) or {}
    values = {**values, **copy.deepcopy(extra)}
    with helm.Chart.load(stack.CHART) as chart:
        rendered = chart.render(values, name="rl", namespace="ml")
    return [
        d
        for n, t in sorted(rendered.items())
        if n.endswith(".yaml")
        for d in yaml.safe_load_all(t)
        if d
    ]


def validate_monitor(doc: dict[str, Any]) -> None:
    schema = {**SCHEMAS["definitions"][doc["kind"]], "definitions": SCHEMAS["definitions"]}
    jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e  # the only operator the chart uses
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def test_off_by_default() -> None:
    kinds = {d["kind"] for d in stack.render_chart("default")}
    assert not kinds & {"ServiceMonitor", "PodMonitor"}
    assert not any(d["metadata"]["name"].endswith("-dashboard") for d in stack.render_chart("cpu"))


@pytest.mark.parametrize("values", list(stack.VALUES_FILES))
def test_monitors_validate_and_lint(values: str) -> None:
    path = stack.VALUES_FILES[values]
    merged = {**((yaml.safe_load(path.read_text()) if path else None) or {}), **ALL_ON}
    report = helm.lint(stack.CHART, merged, strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2]
    docs = render(values, ALL_ON)
    monitors = [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert sorted(d["kind"] for d in monitors) == ["PodMonitor", "ServiceMonitor"]
    for doc in monitors:
        validate_monitor(doc)
        assert doc["metadata"]["name"] == "rl-searchr1"
    for doc in docs:
        if doc["kind"] not in ("ServiceMonitor", "PodMonitor"):
            kv.validate(doc, kv.latest_version(), strict=True)


def test_schema_rejects_a_typo() -> None:
    sm = next(d for d in render("default", ALL_ON) if d["kind"] == "ServiceMonitor")
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["intreval"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        validate_monitor(bad)
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["interval"] = "30 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate_monitor(bad)


@pytest.mark.parametrize("values", ["default", "cpu"])
def test_service_monitor_scrapes_each_service_once(values: str) -> None:
    docs = render(values, ALL_ON)
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    [endpoint] = sm["spec"]["endpoints"]
    keep = next(r for r in endpoint["relabelings"] if r["action"] == "keep")
    services = [d for d in docs if d["kind"] == "Service"]
    scraped = [
        s["metadata"]["name"]
        for s in services
        if selects(sm["spec"]["selector"], s["metadata"]["labels"])
        and re.fullmatch(keep["regex"], s["metadata"]["name"])
    ]
    assert sorted(scraped) == [
        f"rl-searchr1-{c}" for c in ("inference", "orchestrator", "retriever", "trainer")
    ]
    for name in scraped:
        svc = next(s for s in services if s["metadata"]["name"] == name)
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}


@pytest.mark.parametrize("values", ["default", "cpu"])
def test_pod_monitor_reaches_every_service_pod(values: str) -> None:
    docs = render(values, ALL_ON)
    pm = next(d for d in docs if d["kind"] == "PodMonitor")
    router = stack.chart_values(values)["inference"]["router"]["enabled"]
    ports = {e["port"] for e in pm["spec"]["podMetricsEndpoints"]}
    assert ports == ({"http", "metrics"} if router else {"http"})
    pods = [d for d in docs if stack.pod_spec(d) is not None]
    for d in pods:
        labels = d["spec"]["template"]["metadata"]["labels"]
        component = labels["app.kubernetes.io/component"]
        if component == "redis":
            assert not selects(pm["spec"]["selector"], labels)
            continue
        assert selects(pm["spec"]["selector"], labels), component
        names = {p["name"] for c in stack.pod_spec(d)["containers"] for p in c.get("ports", [])}
        assert ("metrics" if component == "router" else "http") in names, component


def _registered_metrics() -> dict[str, set[str]]:
    """Sample name -> label names, for every metric the services register."""
    from prometheus_client import REGISTRY

    for m in METRIC_MODULES:
        importlib.import_module(m)
    out: dict[str, set[str]] = {}
    # Label names of a metric with no sample yet are only on the collector (private API).
    for collector, names in list(REGISTRY._collector_to_names.items()):
        labels = set(getattr(collector, "_labelnames", ()))
        for name in names:
            out[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return out


ROUTER_METRICS = Path(__file__).parent / "sglang_router_0.3.2.metrics"


def _router_metrics() -> dict[str, set[str]]:
    """Sample name -> label names of sglang-router 0.3.2's metrics, as a real router exposed
    them (recorded: tests/unit/deploy/sglang_router_0.3.2.metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(ROUTER_METRICS.read_text()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_dashboard_queries_real_metrics() -> None:
    docs = render("default", ALL_ON)
    cm = next(d for d in docs if d["metadata"]["name"] == "rl-searchr1-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"]["grafana_folder"] == "RL"
    dash = json.loads(cm["data"]["searchr1.json"])
    assert dash["uid"] == "searchr1"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    # Ours, and sglang-router's own (smg_*: the "Router" row, scraped on its metrics port).
    registered = _registered_metrics() | _router_metrics()
    used = set()
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            names = re.findall(r"(?:searchr1|smg)_[a-z_]+", expr)
            assert names, expr
            for name in names:
                assert name in registered, f"{p['title']}: {name} is not a registered metric"
                used.add(name)
            for group in re.findall(r"by \(([^)]*)\)", expr):
                for label in (x.strip() for x in group.split(",")):
                    assert any(label in registered[n] for n in names), (p["title"], label)
            for label in re.findall(r"\{\{(\w+)\}\}", t.get("legendFormat", "")):
                assert any(label in registered[n] for n in names), (p["title"], label)
    # The headline series of each service are on the board.
    for name in (
        "searchr1_trainer_metric",
        "searchr1_rollout_samples_total",
        "searchr1_http_requests_total",
        "searchr1_inference_output_tokens_total",
        "searchr1_retriever_queries_total",
        "searchr1_bus_backlog",
        "smg_router_requests_total",
        "smg_worker_health",
        "searchr1_gateway_live_sessions",
        "searchr1_gateway_rejected_total",
        "searchr1_gateway_dead_lettered_sessions_total",
        "searchr1_gateway_groups_total",
        "searchr1_gateway_engine_seconds_bucket",
    ):
        assert name in used


def test_the_router_row_shows_only_router_metrics() -> None:
    """The router's panels are in a row of their own (empty without a router), and only they
    query sglang-router's metrics."""
    dash = json.loads((stack.CHART / "dashboards" / "searchr1.json").read_text())
    row = None
    for p in dash["panels"]:
        if p["type"] == "row":
            row = p["title"]
            continue
        router = any("smg_" in t["expr"] for t in p["targets"])
        assert router == (row == "Router (sglang-router)"), p["title"]
        if router:
            assert all("smg_" in t["expr"] and "searchr1_" not in t["expr"] for t in p["targets"])


def test_the_gateway_row_holds_the_gateway_panels() -> None:
    """The gateway's panels (empty without the gateway) are in their own row, and only they
    query its metrics."""
    dash = json.loads((stack.CHART / "dashboards" / "searchr1.json").read_text())
    row, seen = None, 0
    for p in dash["panels"]:
        if p["type"] == "row":
            row = p["title"]
            continue
        gateway = any("searchr1_gateway_" in t["expr"] for t in p["targets"])
        assert gateway == (row == "Gateway (agent programs)"), p["title"]
        seen += gateway
    assert seen == 5
