"""Alert rules: k8s/searchr1/alerts/searchr1.rules.yaml for plain Prometheus and the chart's
PrometheusRule (values monitoring.prometheusRule, off by default) wrapping the same groups.

Each rule has promtool unit tests (tests/unit/deploy/alerts/searchr1.rules.test.yaml: it fires
on its fault, stays silent on a healthy series); they run where `promtool` is installed (Debian
package `prometheus`) and are skipped, saying so, elsewhere. Every metric a rule queries must
be one the services register, with the labels the rule uses.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from tests.unit.deploy import stack
from tests.unit.deploy.test_monitoring import _registered_metrics, render

RULES = stack.CHART / "alerts" / "searchr1.rules.yaml"
RULE_TESTS = Path(__file__).parent / "alerts" / "searchr1.rules.test.yaml"
SCHEMA = json.loads(
    (Path(__file__).parent / "schemas" / "prometheusrule.monitoring.coreos.com_v1.json").read_text()
)
RULES_ON = {"monitoring": {"prometheusRule": {"enabled": True, "labels": {"release": "prom"}}}}
# What the issue asks to watch, by alert name.
EXPECTED_ALERTS = {
    "SearchR1TrainingStalled",
    "SearchR1DeadLetters",
    "SearchR1TISEffectiveSampleSizeLow",
    "SearchR1ObservationFractionHigh",
    "SearchR1EngineWeightVersionSkew",
    "SearchR1RetrieverBreakerOpen",
    "SearchR1TrainerLeaseLost",
    "SearchR1CheckpointDiskFull",
    "SearchR1GatewaySessionsDeadLettered",
    "SearchR1GatewayRejectionsHigh",
}
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian: apt-get install prometheus): the alert rules' "
    "promtool checks and unit tests did not run",
)


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_the_rules_cover_what_to_watch_and_each_has_tests() -> None:
    names = [r["alert"] for r in rules()]
    assert sorted(names) == sorted(EXPECTED_ALERTS)
    tested = {
        case["alertname"]
        for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in t.get("alert_rule_test", [])
    }
    assert tested == EXPECTED_ALERTS
    for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        cases = t["alert_rule_test"]
        # Each rule is seen silent and firing.
        assert any(not c["exp_alerts"] for c in cases) and any(c["exp_alerts"] for c in cases)


def test_rules_query_registered_metrics_and_labels() -> None:
    registered = _registered_metrics()
    for rule in rules():
        expr = rule["expr"]
        names = re.findall(r"searchr1_[a-z_]+", expr)
        assert names, rule["alert"]
        for name in names:
            assert name in registered, f"{rule['alert']}: {name} is not a registered metric"
        for selector in re.findall(r"searchr1_[a-z_]+\{([^}]*)\}", expr):
            for label in re.findall(r"(\w+)\s*=", selector):
                assert any(label in registered[n] for n in names), (rule["alert"], label)
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                assert any(label in registered[n] for n in names), (rule["alert"], label)


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    out = subprocess.run(
        [str(PROMTOOL), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_rule_unit_tests() -> None:
    out = subprocess.run(
        [str(PROMTOOL), "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_rule_off_by_default() -> None:
    for values in stack.VALUES_FILES:
        assert not [d for d in stack.render_chart(values) if d["kind"] == "PrometheusRule"]


@pytest.mark.parametrize("values", list(stack.VALUES_FILES))
def test_prometheus_rule_renders_the_rules_file(values: str) -> None:
    path = stack.VALUES_FILES[values]
    merged = {**((yaml.safe_load(path.read_text()) if path else None) or {}), **RULES_ON}
    report = helm.lint(stack.CHART, merged, strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2]
    [doc] = [d for d in render(values, RULES_ON) if d["kind"] == "PrometheusRule"]
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft7Validator)
    assert doc["metadata"]["name"] == "rl-searchr1"
    assert doc["metadata"]["labels"]["release"] == "prom"
    # The same groups, byte for byte after parsing: Prometheus' {{ $labels }} not templated.
    assert doc["spec"] == yaml.safe_load(RULES.read_text())


def test_schema_rejects_a_typo() -> None:
    [doc] = [d for d in render("default", RULES_ON) if d["kind"] == "PrometheusRule"]
    bad = copy.deepcopy(doc)
    bad["spec"]["groups"][0]["rules"][0]["fro"] = "5m"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA, cls=jsonschema.Draft7Validator)
    bad = copy.deepcopy(doc)
    bad["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA, cls=jsonschema.Draft7Validator)
