"""The gateway as a deployed service (docs/gateway.md, "Deploy"): its compose service under the
`gateway` profile and its Deployment in the chart (off by default), wired like the others:
token, Redis, the engine (or router), probes, scraping, NetworkPolicies, colocated placement.
The generic checks (ports, env names, probe paths, CLI, strict validation) run on it through
values-gateway.yaml in test_drift.py, test_chart.py and test_closed_by_default_chart.py."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlparse

import helm_python as helm
import pytest
import yaml
from kubernetes_validate import utils as kv

from searchr1.service import InsecureListener, check_exposure
from tests.unit.deploy import stack

COMPONENT = "app.kubernetes.io/component"
ON = {"gateway": {"enabled": True}}


def _render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    with helm.Chart.load(stack.CHART) as chart:
        rendered = chart.render(values, name="rl", namespace="ml")
    return [
        d for n, t in rendered.items() if n.endswith(".yaml") for d in yaml.safe_load_all(t) if d
    ]


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _gateway_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = _named(docs, "Deployment", "rl-searchr1-gateway")
    [c] = stack.pod_spec(deployment)["containers"]
    return c


def _peer_components(policy: dict[str, Any], port: int) -> set[str]:
    """Components of this release admitted on `port` (or on every port)."""
    out = set()
    for rule in policy["spec"].get("ingress", []):
        ports = {p["port"] for p in rule.get("ports", [])}
        if ports and port not in ports:
            continue
        for peer in rule["from"]:
            labels = peer.get("podSelector", {}).get("matchLabels", {})
            if COMPONENT in labels:
                out.add(labels[COMPONENT])
    return out


# ---------------------------------------------------------------------------------- compose


def test_compose_gateway_is_opt_in_with_its_own_image() -> None:
    svc = stack.compose_raw()["services"]["gateway"]
    # Off unless asked for (`--profile gpu --profile gateway`): the stack's loop is the
    # orchestrator's; the gateway only matters once agent programs call it.
    assert svc["profiles"] == ["gateway"]
    assert svc["build"]["dockerfile"] == "docker/gateway.Dockerfile"
    assert svc["image"].startswith("${SEARCHR1_IMAGE_PREFIX:-searchr1}/gateway:")
    assert svc["restart"] == "unless-stopped"  # a server, not a job
    c = stack.compose_containers()["gateway"]
    assert c.argv[:2] == ["gateway", "serve"]
    stack.check_cli(c.argv)


def test_compose_gateway_has_token_redis_engine_and_a_health_check() -> None:
    raw = stack.compose_raw()["services"]
    c = stack.compose_containers()["gateway"]
    assert c.raw_env["SEARCHR1_ADMIN_TOKEN"].startswith("${SEARCHR1_ADMIN_TOKEN:?")
    assert "${REDIS_PASSWORD" in c.raw_env["SEARCHR1_REDIS__URL"]
    cfg = stack.load_with_env({k: v for k, v in c.env.items() if k.startswith("SEARCHR1_")})
    assert cfg.admin_token and cfg.redis.url
    # It listens for other containers, so it must have the token (it refuses otherwise).
    assert cfg.gateway.http.host == "0.0.0.0" and cfg.gateway.http.port in c.ports
    check_exposure(cfg.gateway.http, token_set=True)
    with pytest.raises(InsecureListener):
        check_exposure(cfg.gateway.http, token_set=False)
    assert c.probes["healthcheck"] == (cfg.gateway.http.port, "/ready")
    # The engine of either profile, under the alias both engines carry.
    engine = urlparse(cfg.gateway.engine_url)
    for name in ("inference", "inference-cpu"):
        assert engine.hostname in raw[name]["networks"]["default"]["aliases"], name
        assert engine.port in stack.compose_containers()[name].ports, name
    waits = raw["gateway"]["depends_on"]
    assert waits["redis"] == {"condition": "service_healthy"}  # required
    for name in ("inference", "inference-cpu"):  # one per profile: neither is required alone
        assert waits[name] == {"condition": "service_healthy", "required": False}


def test_compose_gateway_reads_the_tokenizer_where_the_engine_loads_the_model() -> None:
    raw = stack.compose_raw()["services"]

    def mount(name: str, volume: str) -> str:
        [target] = [v.split(":")[1] for v in raw[name]["volumes"]
                    if isinstance(v, str) and v.split(":")[0] == volume]  # fmt: skip
        return target

    assert mount("gateway", "models") == mount("inference", "models") == "/models"
    assert any(isinstance(v, dict) and v["target"] == "/etc/searchr1/config.yaml"
               for v in raw["gateway"]["volumes"])  # fmt: skip


# ------------------------------------------------------------------------------------ chart


def test_chart_gateway_is_off_by_default() -> None:
    for values in ("default", "cluster", "cpu"):
        assert stack.chart_values(values)["gateway"]["enabled"] is False, values
        assert not [d for d in stack.render_chart(values) if "gateway" in d["metadata"]["name"]]
    assert stack.chart_values("gateway")["gateway"]["enabled"] is True


def test_chart_gateway_deployment_is_wired_like_the_others() -> None:
    docs = _render(ON)
    for doc in docs:
        kv.validate(doc, kv.latest_version(), strict=True)
    deployment = _named(docs, "Deployment", "rl-searchr1-gateway")
    # One process holds the sessions; never two during a rollout.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    c = _gateway_container(docs)
    assert stack._k8s_argv(c) == ["gateway", "serve"]
    assert c["image"].startswith("searchr1/gateway:")
    env = _env(c)
    assert env["SEARCHR1_ADMIN_TOKEN"]["secretKeyRef"] == {
        "name": "rl-searchr1-secrets", "key": "admin-token"}  # fmt: skip
    assert env["SEARCHR1_REDIS__URL"].startswith("redis://:$(REDIS_PASSWORD)@rl-searchr1-redis:")
    # The router's Service (manual policy: the session id is the routing key).
    assert env["SEARCHR1_GATEWAY__ENGINE_URL"] == "http://rl-searchr1-engine:30000"
    engine = _named(docs, "Service", "rl-searchr1-engine")
    assert engine["spec"]["selector"][COMPONENT] == "router"
    # Probes on its port; the startup probe waits as long as it waits for the engine.
    port = int(env["SEARCHR1_GATEWAY__HTTP__PORT"])
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    startup = c["startupProbe"]
    wait_s = float(env["SEARCHR1_GATEWAY__ENGINE_START_TIMEOUT_S"])
    assert startup["periodSeconds"] * startup["failureThreshold"] >= wait_s
    ann = deployment["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == port
    service = _named(docs, "Service", "rl-searchr1-gateway")
    assert service["spec"]["ports"] == [{"name": "http", "port": port, "targetPort": "http"}]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/etc/searchr1", "/models", "/tmp", "/home/searchr1"} <= mounts


def test_chart_gateway_engine_url_without_a_router_selects_the_engines() -> None:
    no_router = {"engine": "torch", "gpus": 0, "router": {"enabled": False}}
    docs = _render({**ON, "inference": no_router})
    assert _env(_gateway_container(docs))["SEARCHR1_GATEWAY__ENGINE_URL"] == (
        "http://rl-searchr1-engine:30000"
    )
    engine = _named(docs, "Service", "rl-searchr1-engine")
    assert engine["spec"]["selector"][COMPONENT] == "inference"
    policy = _named(docs, "NetworkPolicy", "rl-searchr1-inference")
    assert "gateway" in _peer_components(policy, 30000)


def test_chart_gateway_network_policies() -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    agents = {"namespaceSelector": {"matchLabels": {"name": "agents"}}}
    values = {
        "gateway": {"enabled": True, "allowFrom": [agents]},
        "security": {"networkPolicy": {"metricsFrom": [prometheus]}},
    }
    docs = _render(values)
    policy = _named(docs, "NetworkPolicy", "rl-searchr1-gateway")
    kv.validate(policy, kv.latest_version(), strict=True)
    assert policy["spec"]["podSelector"]["matchLabels"][COMPONENT] == "gateway"
    [calls, metrics] = policy["spec"]["ingress"]
    assert calls["ports"] == [{"port": 8300, "protocol": "TCP"}]
    # Agent programs: labelled pods of the namespace, and the listed peers.
    assert calls["from"] == [
        {"podSelector": {"matchLabels": {"rl-searchr1-gateway-client": "true"}}},
        agents,
    ]
    assert metrics["from"] == [prometheus]
    # What it calls admits it: the router (the engines behind it) and Redis.
    assert "gateway" in _peer_components(_named(docs, "NetworkPolicy", "rl-searchr1-router"), 30000)
    assert "gateway" in _peer_components(_named(docs, "NetworkPolicy", "rl-searchr1-redis"), 6379)
    assert "gateway" not in _peer_components(
        _named(docs, "NetworkPolicy", "rl-searchr1-inference"), 30000
    )
    # The agent programs call the tools themselves (docs/examples/openai_agent.py searches):
    # the retriever admits the gateway's clients and allowFrom peers on both its ports.
    retriever = _named(docs, "NetworkPolicy", "rl-searchr1-retriever")
    kv.validate(retriever, kv.latest_version(), strict=True)
    clients = [
        rule
        for rule in retriever["spec"]["ingress"]
        if {"podSelector": {"matchLabels": {"rl-searchr1-gateway-client": "true"}}} in rule["from"]
    ]
    assert len(clients) == 1 and agents in clients[0]["from"]
    assert {p["port"] for p in clients[0]["ports"]} == {8000, 8001}
    # Off: nothing admits it.
    assert "gateway" not in str([d for d in _render(None) if d["kind"] == "NetworkPolicy"])


def test_chart_gateway_is_scraped_by_the_monitors() -> None:
    monitoring = {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}
    docs = _render({**ON, "monitoring": monitoring})
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert "gateway" in sm["spec"]["selector"]["matchExpressions"][0]["values"]
    keep = next(r for r in sm["spec"]["endpoints"][0]["relabelings"] if r["action"] == "keep")
    assert re.fullmatch(keep["regex"], "rl-searchr1-gateway")
    pm = next(d for d in docs if d["kind"] == "PodMonitor")
    assert "gateway" in pm["spec"]["selector"]["matchExpressions"][0]["values"]
    keep = next(
        r for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"] if r["action"] == "keep"
    )
    assert re.fullmatch(keep["regex"], "gateway")


def test_chart_gateway_colocated_sees_a_valid_stack() -> None:
    docs = _render({**ON, "placement": "colocated", "inference": {"router": {"enabled": False}}})
    c = _gateway_container(docs)
    env = {k: v for k, v in _env(c).items() if isinstance(v, str) and k.startswith("SEARCHR1_")}
    cfg = stack.load_with_env(env)
    assert cfg.placement == "colocated" and cfg.orchestrator.mode == "sync"
    # The engines live in the trainer pods: the engine Service selects them, and their policy
    # admits the gateway on the engine ports.
    engine = _named(docs, "Service", "rl-searchr1-engine")
    assert engine["spec"]["selector"][COMPONENT] == "trainer"
    trainer = _named(docs, "NetworkPolicy", "rl-searchr1-trainer")
    assert "gateway" in _peer_components(trainer, 30000)


def test_values_gateway_layers_on_the_cluster_values() -> None:
    """`-f values-cluster.yaml -f values-gateway.yaml`: the gateway's image comes from the same
    registry as the others, and it calls the cluster's router."""
    cluster = yaml.safe_load(stack.VALUES_FILES["cluster"].read_text())
    overlay = yaml.safe_load(stack.VALUES_FILES["gateway"].read_text())
    docs = _render({**cluster, **overlay})
    image = _gateway_container(docs)["image"]
    registry = cluster["images"]["inference"]["repository"].rsplit("/", 1)[0]
    assert image.startswith(f"{registry}/gateway:")
    assert _named(docs, "Service", "rl-searchr1-engine")["spec"]["selector"][COMPONENT] == "router"


def test_chart_orchestrator_can_be_left_out() -> None:
    docs = stack.render_chart("gateway")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    orchestrator = "rl-searchr1-orchestrator"
    assert not names & {("Job", orchestrator), ("Service", orchestrator)}
    assert _gateway_container(list(docs))


def test_values_schema_rejects_a_gateway_typo() -> None:
    report = helm.lint(stack.CHART, {"gateway": {"enabeld": True}}, strict=True)
    assert any("enabeld" in e for e in report["errors"])
