"""The Helm chart: lint, render and strict schema validation, offline, for both values files."""

from __future__ import annotations

import copy
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from kubernetes_validate import utils as kv

from tests.unit.deploy import stack

VALUES = list(stack.VALUES_FILES)
# The oldest Kubernetes the chart supports (Indexed Jobs, downward-API completion index) and the
# newest schema bundled with kubernetes-validate.
K8S_VERSIONS = ["1.30.0", kv.latest_version()]


def _values(name: str) -> dict | None:
    path = stack.VALUES_FILES[name]
    return yaml.safe_load(path.read_text()) if path else None


def _of_kind(docs, kind: str) -> list[dict]:  # type: ignore[no-untyped-def]
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("values", VALUES)
def test_lint_is_clean(values: str) -> None:
    report = helm.lint(stack.CHART, _values(values), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", VALUES)
def test_manifests_validate_strictly(values: str, version: str) -> None:
    docs = stack.render_chart(values)
    assert len(docs) > 10
    for doc in docs:
        kv.validate(doc, version, strict=True)


def test_strict_validation_rejects_a_typo() -> None:
    # The validator must be able to fail: an unknown field in a container.
    doc = copy.deepcopy(next(d for d in stack.render_chart("default") if d["kind"] == "Deployment"))
    doc["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("values", VALUES)
def test_shipped_stack_config_loads(values: str, tmp_path: Path) -> None:
    cm = next(d for d in stack.render_chart(values) if d["kind"] == "ConfigMap")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    stack.load_with_env({}, path)


@pytest.mark.parametrize("values", VALUES)
def test_pods_are_non_root_scraped_and_wired(values: str) -> None:
    docs = stack.render_chart(values)
    claims = {d["metadata"]["name"] for d in _of_kind(docs, "PersistentVolumeClaim")}
    merged = stack.chart_values(values)
    claims |= {p["existingClaim"] for p in merged["persistence"].values() if p["existingClaim"]}
    secret_keys = {k for s in _of_kind(docs, "Secret") for k in s["data"]}
    own_secret = {s["metadata"]["name"] for s in _of_kind(docs, "Secret")}
    for doc in docs:
        spec = stack.pod_spec(doc)
        if spec is None:
            continue
        name = doc["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        ann = doc["spec"]["template"]["metadata"].get("annotations", {})
        ports = {p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        if not name.endswith("-redis"):
            assert ann.get("prometheus.io/scrape") == "true", name
            assert int(ann["prometheus.io/port"]) in ports, name
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, (name, v)
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert "livenessProbe" in c and "readinessProbe" in c, (name, c["name"])
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] in own_secret and not ref.get("optional"):
                    assert ref["key"] in secret_keys, (name, e["name"])


@pytest.mark.parametrize("values", VALUES)
def test_services_select_pods_and_named_ports(values: str) -> None:
    docs = stack.render_chart(values)
    pods = [
        (d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"])
        for d in docs
        if stack.pod_spec(d) is not None
    ]
    for svc in _of_kind(docs, "Service"):
        sel = svc["spec"]["selector"]
        matching = [s for labels, s in pods if sel.items() <= labels.items()]
        assert matching, f"Service {svc['metadata']['name']} selects no pod"
        names = {p.get("name") for s in matching for c in s["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)


def test_cluster_values_scale_out_on_gpus() -> None:
    docs = stack.render_chart("cluster")
    merged = stack.chart_values("cluster")

    def gpus(doc) -> int:  # type: ignore[no-untyped-def]
        c = stack.pod_spec(doc)["containers"][0]
        limits = c["resources"].get("limits", {})
        assert limits.get("nvidia.com/gpu") == c["resources"]["requests"].get("nvidia.com/gpu")
        return int(limits.get("nvidia.com/gpu", 0))

    by_name = {d["metadata"]["name"]: d for d in docs if stack.pod_spec(d) is not None}
    inference, trainer = by_name["rl-searchr1-inference"], by_name["rl-searchr1-trainer"]
    assert inference["spec"]["replicas"] * gpus(inference) == 4
    assert trainer["spec"]["completionMode"] == "Indexed"
    nodes = trainer["spec"]["completions"]
    assert nodes == trainer["spec"]["parallelism"] == merged["trainer"]["nodes"] == 2
    assert nodes * gpus(trainer) == 4
    assert gpus(by_name["rl-searchr1-retriever"]) == 1
    cmd = stack.pod_spec(trainer)["containers"][0]["command"]
    assert "--nnodes=2" in cmd and "--nproc-per-node=2" in cmd and "--node-rank=$(NODE_RANK)" in cmd
    env = {e["name"] for e in stack.pod_spec(trainer)["containers"][0]["env"]}
    assert {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"} <= env
    # The router fronts every engine replica.
    router = stack.pod_spec(by_name["rl-searchr1-router"])["containers"][0]["command"]
    workers = router[router.index("--worker-urls") + 1 :]
    assert len(workers) == inference["spec"]["replicas"]
    # ... by affinity (a sample's turns on one engine), from one router holding the key table.
    at = router.index("--policy")
    assert router[at : at + 4] == ["--policy", "manual", "--assignment-mode", "min_load"]
    assert by_name["rl-searchr1-router"]["spec"]["replicas"] == 1


def test_default_values_run_one_gpu_per_gpu_service() -> None:
    docs = stack.render_chart("default")
    by_name = {d["metadata"]["name"]: d for d in docs if stack.pod_spec(d) is not None}
    for name in ("rl-searchr1-inference", "rl-searchr1-trainer"):
        res = stack.pod_spec(by_name[name])["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == 1, name
    assert "nvidia.com/gpu" not in str(stack.pod_spec(by_name["rl-searchr1-retriever"]))
    redis = by_name["rl-searchr1-redis"]
    assert redis["kind"] == "StatefulSet" and redis["spec"]["volumeClaimTemplates"]
    cmd = " ".join(stack.pod_spec(redis)["containers"][0]["command"])
    assert "--appendonly yes" in cmd and "--requirepass" in cmd


def test_external_redis_and_no_router() -> None:
    values = {
        "redis": {"enabled": False, "externalUrl": "redis://:pw@redis.example:6379/0"},
        "inference": {"engine": "torch", "gpus": 0, "router": {"enabled": False}},
    }
    with helm.Chart.load(stack.CHART) as chart:
        rendered = chart.render(values, name="rl", namespace="ml")
    texts = [t for n, t in rendered.items() if n.endswith(".yaml")]
    docs = [d for t in texts for d in yaml.safe_load_all(t) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("StatefulSet", "rl-searchr1-redis") not in names
    assert ("Deployment", "rl-searchr1-router") not in names
    # The orchestrator's engine URL still resolves: the Service now selects the engines.
    engine = next(d for d in docs if d["metadata"]["name"] == "rl-searchr1-engine")
    assert engine["spec"]["selector"]["app.kubernetes.io/component"] == "inference"
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert "redis-url" in secret["data"]
    for d in docs:
        kv.validate(d, K8S_VERSIONS[0], strict=True)


def test_values_schema_rejects_typos() -> None:
    report = helm.lint(stack.CHART, {"inferance": {"replicas": 2}}, strict=True)
    assert any("inferance" in e for e in report["errors"])


def test_values_schema_enums_are_the_codes() -> None:
    import json
    import re
    import typing

    from inference.config import InferenceConfig
    from trainer.config import PushMode, WeightPushConfig

    props = json.loads((stack.CHART / "values.schema.json").read_text())["properties"]
    push = props["trainer"]["properties"]["weightPush"]["properties"]
    assert set(push["mode"]["enum"]) == {m.value for m in PushMode}
    pattern = WeightPushConfig.model_fields["backend"].metadata[0].pattern
    alternatives = re.fullmatch(r"\^\((.*)\)\$", pattern)
    assert alternatives and set(push["backend"]["enum"]) == set(alternatives.group(1).split("|"))
    engines = typing.get_args(InferenceConfig.model_fields["engine"].annotation)
    assert set(props["inference"]["properties"]["engine"]["enum"]) == set(engines)


def test_cpu_values_need_no_gpu() -> None:
    docs = stack.render_chart("cpu")
    assert "nvidia.com/gpu" not in str(docs)
    assert not any(d["metadata"]["name"].endswith("-router") for d in docs)
    trainer = next(d for d in docs if d["kind"] == "Job" and "trainer" in d["metadata"]["name"])
    c = stack.pod_spec(trainer)["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["SEARCHR1_TRAINER__MODEL__DEVICE"] == "cpu"
    assert env["SEARCHR1_TRAINER__WEIGHT_PUSH__BACKEND"] == "gloo"
    assert not any(k.startswith("NCCL_") for k in env)
    assert "--nproc-per-node=1" in c["command"]


@pytest.mark.parametrize("values", VALUES)
def test_redis_fsyncs_every_write(values: str) -> None:
    """With everysec a crash can lose an acknowledged ack; XAUTOCLAIM then hands the entries
    out again and they are trained twice."""
    docs = stack.render_chart(values)
    redis = [d for d in docs if d["metadata"]["name"].endswith("-redis") and stack.pod_spec(d)]
    if not redis:
        pytest.skip("this values file uses an external Redis")
    cmd = " ".join(" ".join(c.get("command", []) + c.get("args", []))
                   for c in stack.pod_spec(redis[0])["containers"])  # fmt: skip
    assert "--appendfsync always" in cmd
    # Full, it refuses writes instead of evicting stream entries (lost training data).
    assert "--maxmemory-policy noeviction" in cmd and "--maxmemory " in cmd
