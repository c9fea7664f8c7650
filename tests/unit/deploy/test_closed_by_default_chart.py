"""The chart is closed by default: NetworkPolicies let each pod be reached only by the services
that call it (strict validation of every rendered manifest is in test_chart.py), and every
container runs on a read-only root filesystem with emptyDirs where it writes."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
import yaml
from kubernetes_validate import utils as kv

from tests.unit.deploy import stack

VALUES = list(stack.VALUES_FILES)
COMPONENT = "app.kubernetes.io/component"


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(stack.CHART) as chart:
        rendered = chart.render(values, name="rl", namespace="ml")
    return [
        d for n, t in rendered.items() if n.endswith(".yaml") for d in yaml.safe_load_all(t) if d
    ]


def _policies(docs: Any) -> dict[str, dict[str, Any]]:
    """NetworkPolicies by the component they select ("*": the release-wide one)."""
    out = {}
    for d in docs:
        if d["kind"] == "NetworkPolicy":
            labels = d["spec"]["podSelector"]["matchLabels"]
            out[labels.get(COMPONENT, "*")] = d
    return out


def _callers(policy: dict[str, Any]) -> dict[str, set[int | None]]:
    """Component -> ports it may reach (None: every port)."""
    out: dict[str, set[int | None]] = {}
    for rule in policy["spec"].get("ingress", []):
        ports = {p["port"] for p in rule.get("ports", [])} or {None}
        for peer in rule["from"]:
            # Only pod selectors of this release: no namespaces, no IP blocks.
            assert set(peer) == {"podSelector"}, peer
            labels = peer["podSelector"]["matchLabels"]
            assert labels["app.kubernetes.io/instance"] == "rl"
            out.setdefault(labels[COMPONENT], set()).update(ports)
    return out


@pytest.mark.parametrize("values", VALUES)
def test_every_pod_denies_ingress_by_default(values: str) -> None:
    docs = stack.render_chart(values)
    policies = _policies(docs)
    deny = policies["*"]["spec"]
    assert deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    for doc in docs:
        spec = stack.pod_spec(doc)
        if spec is None:
            continue
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert set(deny["podSelector"]["matchLabels"].items()) <= set(labels.items())
        assert labels[COMPONENT] in policies, doc["metadata"]["name"]


@pytest.mark.parametrize("values", VALUES)
def test_each_service_is_reached_only_by_its_callers(values: str) -> None:
    v = stack.chart_values(values)
    policies = _policies(stack.render_chart(values))
    retriever = {v["retriever"]["port"], v["retriever"]["grpcPort"]}
    router, gateway = v["inference"]["router"]["enabled"], v["gateway"]["enabled"]
    # With the gateway on, agent programs (pods carrying its client label) call the retriever
    # themselves: that rule is the gateway's own test's (test_gateway_deploy.py).
    client = {"podSelector": {"matchLabels": {"rl-searchr1-gateway-client": "true"}}}
    rules = policies["retriever"]["spec"]["ingress"]
    release = [r for r in rules if client not in r["from"]]
    assert len(rules) - len(release) == int(gateway)
    assert _callers({"spec": {"ingress": release}}) == {"orchestrator": retriever}
    engine = _callers(policies["inference"])
    # The weight group (NCCL's own sockets) and the admin routes: the trainer only.
    assert engine.pop("trainer") == {None}
    http = {v["inference"]["port"]}
    # The gateway calls the engines through the router when there is one.
    expected = (
        {"orchestrator": http}
        | ({"router": http} if router else {})
        | ({"gateway": http} if gateway and not router else {})
    )
    assert engine == expected
    # Torchrun's rendezvous and the weight group's master port live on the trainer pods.
    assert _callers(policies["trainer"]) == {"trainer": {None}, "inference": {None}}
    assert _callers(policies["orchestrator"]) == {}
    redis = {v["redis"]["port"]}
    assert _callers(policies["redis"]) == {"orchestrator": redis, "trainer": redis} | (
        {"gateway": redis} if gateway else {}
    )
    if router:
        proxy = {v["inference"]["router"]["port"]}
        callers = {"orchestrator": proxy, "trainer": proxy}
        assert _callers(policies["router"]) == callers | ({"gateway": proxy} if gateway else {})
    assert ("gateway" in policies) == gateway


def test_metrics_peers_reach_every_http_port_and_policies_can_be_off() -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    docs = _render({"security": {"networkPolicy": {"metricsFrom": [prometheus]}}})
    for policy in _policies(docs).values():
        if policy["spec"]["podSelector"]["matchLabels"].get(COMPONENT) in (None, "redis"):
            continue
        assert any(prometheus in r["from"] for r in policy["spec"]["ingress"]), policy
        kv.validate(policy, kv.latest_version(), strict=True)
    off = _render({"security": {"networkPolicy": {"enabled": False}}})
    assert not _policies(off)


@pytest.mark.parametrize("values", VALUES)
def test_containers_have_a_read_only_root_and_writable_scratch(values: str) -> None:
    for doc in stack.render_chart(values):
        spec = stack.pod_spec(doc)
        if spec is None:
            continue
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
            if doc["metadata"]["name"].endswith("-redis"):
                continue  # writes only its data volume
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            for path in ("/tmp", "/home/searchr1"):
                assert "emptyDir" in volumes[mounts[path]], (c["name"], path)
