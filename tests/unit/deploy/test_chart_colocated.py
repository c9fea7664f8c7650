"""The Helm chart's colocated placement (`placement: colocated`, values-colocated-slime.yaml):
trainer ranks and engines in one pod per node, on the same GPUs, one IPC namespace and one
/dev/shm, weights handed over in memory. Offline: helm template, strict schemas, the real CLI
and config models. The disaggregated default is unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import helm_python as helm
import pytest
import yaml
from kubernetes_validate import utils as kv

from tests.unit.deploy import stack
from tests.unit.deploy.test_chart import K8S_VERSIONS

SLIME = stack.CHART / "values-colocated-slime.yaml"
CPU = {
    "placement": "colocated",
    "inference": {"engine": "torch", "gpus": 0, "router": {"enabled": False}},
    "trainer": {"gpusPerNode": 0, "weightPush": {"backend": "gloo"}},
}
GPU = "nvidia.com/gpu"


def _slime() -> dict[str, Any]:
    return yaml.safe_load(SLIME.read_text())


def _render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    with helm.Chart.load(stack.CHART) as chart:
        rendered = chart.render(values, name="rl", namespace="ml")
    texts = [t for n, t in sorted(rendered.items()) if n.endswith(".yaml")]
    return [d for t in texts for d in yaml.safe_load_all(t) if d]


def _workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if stack.pod_spec(d) is not None}


def _env(c: dict[str, Any]) -> dict[str, str]:
    return stack._k8s_env(c)[0]


def _pod(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The trainer Job's pod spec and its containers by name."""
    job = _workloads(_render(values))["rl-searchr1-trainer"]
    assert job["kind"] == "Job"
    spec = stack.pod_spec(job)
    return spec, {c["name"]: c for c in spec["containers"]}


def test_slime_values_lint_and_validate_strictly() -> None:
    report = helm.lint(stack.CHART, _slime(), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report
    docs = _render(_slime())
    for version in K8S_VERSIONS:
        for doc in docs:
            kv.validate(doc, version, strict=True)


def test_one_pod_template_holds_the_trainer_and_the_engines() -> None:
    docs = _render(_slime())
    workloads = _workloads(docs)
    # No inference StatefulSet (nor its headless Service): the engines live in the trainer pods.
    assert "rl-searchr1-inference" not in {d["metadata"]["name"] for d in docs}
    assert not [d for d in docs if d["kind"] == "StatefulSet" and "inference" in str(d["metadata"])]
    gpu_pods = [n for n, d in workloads.items() if GPU in str(stack.pod_spec(d))]
    assert gpu_pods == ["rl-searchr1-trainer"]
    job = workloads["rl-searchr1-trainer"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 1  # one node
    _, containers = _pod(_slime())
    assert list(containers) == ["trainer", "engine-0", "engine-1"]
    assert "--nproc-per-node=4" in containers["trainer"]["command"]
    for name in ("engine-0", "engine-1"):
        argv = stack._k8s_argv(containers[name])
        assert argv[:4] == ["inference", "serve", "--engine", "sglang"], argv
        stack.check_cli(argv)
    stack.check_cli(stack._k8s_argv(containers["trainer"]))
    # The trainer trains the model the engines serve.
    t_model = stack.check_cli(stack._k8s_argv(containers["trainer"])).params["model"]
    e_model = stack.check_cli(stack._k8s_argv(containers["engine-0"])).params["model"]
    assert str(t_model) == str(e_model)


def test_gpus_requested_once_and_visible_to_every_container() -> None:
    _, containers = _pod(_slime())
    trainer = containers["trainer"]
    res = trainer["resources"]
    assert res["requests"][GPU] == res["limits"][GPU] == 4
    assert _env(trainer)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    tp_sizes, base_ids = [], []
    for name in ("engine-0", "engine-1"):
        c = containers[name]
        assert GPU not in str(c["resources"]), name  # a second request would be other GPUs
        env = _env(c)
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all", name
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", name
        cfg = stack.load_with_env({k: v for k, v in env.items() if k.startswith("SEARCHR1_")})
        tp_sizes.append(cfg.inference.sglang.tp_size)
        extra = cfg.inference.sglang.extra_args
        base_ids.append(int(extra[extra.index("--base-gpu-id") + 1]))
        assert "--enable-memory-saver" in extra  # /release_memory_occupation needs it
    # slime's layout: two engines at TP2 on GPUs 0-1 and 2-3.
    assert tp_sizes == [2, 2] and base_ids == [0, 2]


def test_dev_shm_is_one_memory_emptydir_in_every_container() -> None:
    spec, containers = _pod(_slime())
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = [n for c in containers.values() for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"
           for n in [m["name"]]]  # fmt: skip
    assert len(shm) == len(containers) and len(set(shm)) == 1
    vol = volumes[shm[0]]["emptyDir"]
    assert vol["medium"] == "Memory"
    assert vol["sizeLimit"] == _slime()["colocated"]["shmSize"]
    # One pod: one IPC namespace already; nothing may ask for the host's.
    assert not spec.get("hostIPC") and not spec.get("hostPID")


def test_the_push_env_hands_over_to_this_pods_engines() -> None:
    _, containers = _pod(_slime())
    env = _env(containers["trainer"])
    assert env["SEARCHR1_TRAINER__WEIGHT_PUSH__MODE"] == "handover"
    assert env["SEARCHR1_TRAINER__WEIGHT_PUSH__RELEASE_ENGINES_WHILE_TRAINING"] == "true"
    assert env["SEARCHR1_TRAINER__WEIGHT_PUSH__HANDOVER_FORMAT"] == "sglang"
    cfg = stack.load_with_env({k: v for k, v in env.items() if k.startswith("SEARCHR1_")})
    push = cfg.trainer.weight_push
    assert push.mode == "handover" and push.release_engines_while_training
    assert push.handover_format == "sglang"
    assert push.handover_tp_size == 2  # one copy per TP rank of each TP2 engine
    engine_ports = {p["containerPort"] for n in ("engine-0", "engine-1")
                    for p in containers[n]["ports"]}  # fmt: skip
    urls = [urlparse(u) for u in push.engine_urls]
    assert {u.hostname for u in urls} == {"127.0.0.1"}  # the handles are only valid here
    assert {u.port for u in urls} == engine_ports


@pytest.mark.parametrize("values", ["slime", "cpu"])
def test_every_container_sees_a_valid_colocated_stack(values: str, tmp_path: Path) -> None:
    """Each searchr1 container's environment (alone, and over the shipped config file) is a
    valid stack config with placement colocated: stack.config checks sync + handover + release
    together. Every SEARCHR1_ variable names a config field."""
    docs = _render(_slime() if values == "slime" else CPU)
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    seen = set()
    for doc in _workloads(docs).values():
        for c in stack.pod_spec(doc)["containers"]:
            argv = stack._k8s_argv(c)
            if not argv:
                continue
            seen.add(argv[0])
            env = {k: v for k, v in _env(c).items() if k.startswith("SEARCHR1_")}
            for name in env.keys() - {stack.config_file_env()} - stack.secret_env_names():
                assert stack.config_field_path(name), f"{c['name']}: {name} is no config field"
            for cfg in (stack.load_with_env(env), stack.load_with_env(env, path)):
                assert cfg.placement == "colocated", c["name"]
                assert cfg.orchestrator.mode == "sync", c["name"]
            if values == "slime":  # SGLang does not report its dtype: the push casts to it
                assert cfg.trainer.weight_push.dtype == cfg.inference.sglang.dtype == "bfloat16"
    assert seen == set(stack.SERVICES)


def test_engines_are_reachable_by_router_orchestrator_and_policy() -> None:
    docs = _render(_slime())
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workloads = _workloads(docs)
    router = stack.pod_spec(workloads["rl-searchr1-router"])["containers"][0]["command"]
    workers = router[router.index("--worker-urls") + 1 : router.index("--worker-urls") + 3]
    assert workers == [
        "http://rl-searchr1-trainer-0.rl-searchr1-trainer:30000",
        "http://rl-searchr1-trainer-0.rl-searchr1-trainer:30001",
    ]
    headless = services["rl-searchr1-trainer"]["spec"]
    assert headless["clusterIP"] == "None"
    assert {p["port"] for p in headless["ports"]} >= {30000, 30001}
    # Every Service selects pods with the named ports it targets.
    pods = [(d["spec"]["template"]["metadata"]["labels"], stack.pod_spec(d))
            for d in workloads.values()]  # fmt: skip
    for svc in services.values():
        sel = svc["spec"]["selector"]
        matching = [s for labels, s in pods if sel.items() <= labels.items()]
        assert matching, svc["metadata"]["name"]
        names = {p.get("name") for s in matching for c in s["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)
    # The trainer pods' NetworkPolicy lets the orchestrator and the router reach the engines.
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy"
                  and d["metadata"]["name"] == "rl-searchr1-trainer")  # fmt: skip
    allowed: dict[str, set[int]] = {}
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            comp = peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            allowed.setdefault(comp, set()).update(p["port"] for p in rule.get("ports", []))
    assert {30000, 30001} <= allowed["orchestrator"] and {30000, 30001} <= allowed["router"]


def test_engine_probes_hit_served_paths() -> None:
    _, containers = _pod(_slime())
    for name in ("engine-0", "engine-1"):
        c = containers[name]
        port = next(p["name"] for p in c["ports"])
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c[kind]["httpGet"]
            assert probe["port"] == port, (name, kind)
            assert probe["path"] in stack.inference_paths(), (name, kind)
        assert c["readinessProbe"]["httpGet"]["path"] == "/health_generate"  # SGLang


def test_cpu_colocated_shares_dev_shm_and_needs_no_gpu() -> None:
    """On CPU the handover is POSIX shared memory under /dev/shm: the pod's one emptyDir."""
    docs = _render(CPU)
    assert GPU not in str(docs) and "NVIDIA_VISIBLE_DEVICES" not in str(docs)
    _, containers = _pod(CPU)
    assert list(containers) == ["trainer", "engine-0"]
    env = _env(containers["trainer"])
    assert env["SEARCHR1_TRAINER__WEIGHT_PUSH__HANDOVER_FORMAT"] == "searchr1"  # our engine
    assert env["SEARCHR1_TRAINER__MODEL__DEVICE"] == "cpu"
    mounts = [{m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"}
              for c in containers.values()]  # fmt: skip
    assert mounts == [{"dshm"}, {"dshm"}]
    # No router: the orchestrator's engine Service selects the trainer pods' first engine.
    engine = next(d for d in docs if d["metadata"]["name"] == "rl-searchr1-engine")
    assert engine["spec"]["ports"][0]["targetPort"] == "engine-0"
    assert engine["spec"]["selector"]["app.kubernetes.io/component"] == "trainer"
    for doc in docs:
        kv.validate(doc, K8S_VERSIONS[0], strict=True)


def test_engines_must_split_the_gpus_evenly() -> None:
    values = {"placement": "colocated", "colocated": {"enginesPerNode": 3},
              "trainer": {"gpusPerNode": 4}}  # fmt: skip
    with pytest.raises(Exception, match=r"multiple of colocated\.enginesPerNode"):
        _render(values)


def test_one_node_only() -> None:
    """The trainer's main rank hands its memory to the engines of its own node only."""
    with pytest.raises(Exception, match=r"trainer\.nodes must be 1"):
        _render({"placement": "colocated", "trainer": {"nodes": 2}})


def test_schema_rejects_an_unknown_placement() -> None:
    report = helm.lint(stack.CHART, {"placement": "hybrid"}, strict=True)
    assert any("placement" in e for e in report["errors"]), report
    report = helm.lint(stack.CHART, {"colocated": {"enginesPerNod": 2}}, strict=True)
    assert any("enginesPerNod" in e for e in report["errors"]), report
    schema = json.loads((stack.CHART / "values.schema.json").read_text())["properties"]
    from stack.config import Placement

    assert set(schema["placement"]["enum"]) == {p.value for p in Placement}


def test_disaggregated_is_the_default_and_unchanged() -> None:
    """`placement: disaggregated` renders what no placement renders (the Secret's generated
    values aside), with none of the colocated pieces."""

    def without_secrets(values: dict[str, Any] | None) -> list[dict[str, Any]]:
        return [d for d in _render(values) if d["kind"] != "Secret"]

    assert stack.chart_values("default")["placement"] == "disaggregated"
    for name in stack.VALUES_FILES:
        path = stack.VALUES_FILES[name]
        values = yaml.safe_load(path.read_text()) if path else {}
        explicit = {**values, "placement": "disaggregated"}
        assert without_secrets(values or None) == without_secrets(explicit), name
        text = str(without_secrets(values or None))
        for marker in ("engine-0", "NVIDIA_VISIBLE_DEVICES", "handover", "SEARCHR1_PLACEMENT"):
            assert marker not in text, (name, marker)


def test_default_values_colocated_share_one_gpu() -> None:
    docs = _render({"placement": "colocated"})
    for doc in docs:
        kv.validate(doc, K8S_VERSIONS[0], strict=True)
    _, containers = _pod({"placement": "colocated"})
    assert list(containers) == ["trainer", "engine-0"]
    assert containers["trainer"]["resources"]["limits"][GPU] == 1
    env = _env(containers["engine-0"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["SEARCHR1_INFERENCE__SGLANG__TP_SIZE"] == "1"
    assert json.loads(env["SEARCHR1_INFERENCE__SGLANG__EXTRA_ARGS"])[:2] == ["--base-gpu-id", "0"]
    trainer = _env(containers["trainer"])
    assert trainer["SEARCHR1_TRAINER__WEIGHT_PUSH__HANDOVER_TP_SIZE"] == "1"
    assert json.loads(trainer["SEARCHR1_TRAINER__WEIGHT_PUSH__ENGINE_URLS"]) == [
        "http://127.0.0.1:30000"
    ]
