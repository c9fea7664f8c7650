"""The Helm chart's engines that join by pulling (`inference.join.enabled`): engine pods pull
from the weight store on the checkpoints volume and announce their stable name; the trainer
writes the store and pushes to the announced engines; SGLang engines fail the render."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
import yaml
from kubernetes_validate import utils as kv

from tests.unit.deploy import stack
from tests.unit.deploy.test_chart import K8S_VERSIONS

JOIN = {"inference": {"engine": "torch", "gpus": 0, "router": {"enabled": False},
                      "join": {"enabled": True}}}  # fmt: skip


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(stack.CHART) as chart:
        rendered = chart.render(values, name="rl", namespace="ml")
    texts = [t for n, t in sorted(rendered.items()) if n.endswith(".yaml")]
    return [d for t in texts for d in yaml.safe_load_all(t) if d]


def _env(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    doc = next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix))
    c = stack.pod_spec(doc)["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_join_wires_the_store_the_announcement_and_discovery() -> None:
    docs = _render(JOIN)
    for doc in docs:
        kv.validate(doc, K8S_VERSIONS[0], strict=True)
    engine = _env(docs, "StatefulSet", "inference")
    assert engine["SEARCHR1_INFERENCE__JOIN__STORE_DIR"] == "/checkpoints/weight-store"
    assert engine["SEARCHR1_INFERENCE__JOIN__ANNOUNCE"] == "true"
    # The stable name engines.urls lists: a listed engine is never in the push set twice.
    advertised = engine["SEARCHR1_INFERENCE__JOIN__ADVERTISE_URL"]
    assert advertised == "http://$(POD_NAME).rl-searchr1-inference:30000"
    assert engine["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "SEARCHR1_REDIS__URL" in engine
    trainer = _env(docs, "Job", "trainer")
    assert trainer["SEARCHR1_TRAINER__WEIGHT_PUSH__STORE_DIR"] == "/checkpoints/weight-store"
    assert trainer["SEARCHR1_ENGINES__DISCOVER"] == "true"
    for name in ("SEARCHR1_INFERENCE__JOIN__STORE_DIR", "SEARCHR1_ENGINES__DISCOVER"):
        assert stack.config_field_path(name), name


def test_join_is_off_by_default_and_refused_for_sglang() -> None:
    docs = _render({})
    assert "SEARCHR1_INFERENCE__JOIN__STORE_DIR" not in _env(docs, "StatefulSet", "inference")
    assert "SEARCHR1_ENGINES__DISCOVER" not in _env(docs, "Job", "trainer")
    with pytest.raises(Exception, match="the reference engine's"):
        _render({"inference": {"join": {"enabled": True}}})


def test_joining_engines_may_reach_redis() -> None:
    def redis_peers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        policy = next(
            d
            for d in docs
            if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("redis")
        )
        return [p["podSelector"]["matchLabels"] for p in policy["spec"]["ingress"][0]["from"]]

    component = "app.kubernetes.io/component"
    assert "inference" in [p.get(component) for p in redis_peers(_render(JOIN))]
    assert "inference" not in [p.get(component) for p in redis_peers(_render({}))]
