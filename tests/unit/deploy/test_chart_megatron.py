"""The Helm trainer Job on the Megatron backend: `trainer.backend` and `trainer.megatron.*` reach
the trainer's config, torchrun starts tp x pp x dp ranks, and bad layouts fail the render."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from kubernetes_validate import utils as kv

from tests.unit.deploy import stack
from tests.unit.deploy.test_chart import K8S_VERSIONS


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    import yaml

    with helm.Chart.load(stack.CHART) as chart:
        rendered = chart.render(values, name="rl", namespace="ml")
    texts = [t for n, t in sorted(rendered.items()) if n.endswith(".yaml")]
    return [d for t in texts for d in yaml.safe_load_all(t) if d]


def _trainer(values: dict[str, Any]) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """(command, environment, resources) of the trainer container; every manifest validated."""
    docs = _render(values)
    for doc in docs:
        kv.validate(doc, K8S_VERSIONS[0], strict=True)
    job = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].endswith("trainer"))
    c = stack.pod_spec(job)["containers"][0]
    return c["command"], {e["name"]: e.get("value") for e in c["env"]}, c["resources"]


def _trainer_config(env: dict[str, str]) -> Any:
    prefix = stack.env_prefix() + "TRAINER__"
    searchr1_env = {k: v for k, v in env.items() if k.startswith(prefix)}
    for name in searchr1_env:
        assert stack.config_field_path(name), f"{name} is no config field"
    return stack.load_with_env(searchr1_env).trainer


def test_default_backend_is_hf_one_rank_per_gpu() -> None:
    cmd, env, _ = _trainer({})
    assert "--nproc-per-node=1" in cmd
    assert env["SEARCHR1_TRAINER__BACKEND"] == "hf"
    assert not any("MEGATRON" in k for k in env)
    assert _trainer_config(env).backend == "hf"


def test_megatron_layout_sets_the_world_size_and_the_config() -> None:
    values = {
        "trainer": {
            "backend": "megatron",
            "nodes": 2,
            "gpusPerNode": 4,
            "megatron": {"tp": 2, "pp": 2, "dp": 2, "distributedOptimizer": False},
        }
    }
    cmd, env, resources = _trainer(values)
    assert "--nnodes=2" in cmd and "--nproc-per-node=4" in cmd  # 2 x 4 = tp x pp x dp
    assert resources["limits"]["nvidia.com/gpu"] == 4
    cfg = _trainer_config(env)
    assert cfg.backend == "megatron"
    assert (cfg.megatron.tp, cfg.megatron.pp) == (2, 2)
    assert cfg.megatron.distributed_optimizer is False
    assert cfg.megatron.vocab_multiple == 128


def test_megatron_on_cpu_runs_its_ranks_over_gloo() -> None:
    values = {
        "trainer": {
            "backend": "megatron",
            "gpusPerNode": 0,
            "megatron": {"tp": 2},
            "weightPush": {"backend": "gloo"},
        }
    }
    cmd, env, resources = _trainer(values)
    assert "--nproc-per-node=2" in cmd
    assert "nvidia.com/gpu" not in str(resources)
    assert env["SEARCHR1_TRAINER__MODEL__DEVICE"] == "cpu"
    assert _trainer_config(env).megatron.tp == 2


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        (
            {"nodes": 2, "gpusPerNode": 1, "megatron": {"tp": 1, "pp": 1, "dp": 1}},
            "must be a multiple of trainer.nodes",
        ),
        ({"gpusPerNode": 8, "megatron": {"tp": 2, "pp": 1, "dp": 2}}, "must be tp x pp x dp"),
    ],
)
def test_a_layout_that_does_not_fit_fails_the_render(trainer: dict, message: str) -> None:
    with pytest.raises(Exception, match=message):
        _render({"trainer": {"backend": "megatron", **trainer}})


def test_schema_rejects_unknown_backends_and_layout_keys() -> None:
    report = helm.lint(stack.CHART, {"trainer": {"backend": "deepspeed"}}, strict=True)
    assert report["errors"], report
    report = helm.lint(stack.CHART, {"trainer": {"megatron": {"tpp": 2}}}, strict=True)
    assert any("tpp" in e for e in report["errors"]), report


def test_schema_backends_are_the_codes() -> None:
    import json

    from trainer.backends.registry import BACKENDS

    props = json.loads((stack.CHART / "values.schema.json").read_text())["properties"]
    trainer = props["trainer"]["properties"]
    assert set(trainer["backend"]["enum"]) == set(BACKENDS)
    keys = set(trainer["megatron"]["properties"])
    assert keys == {"tp", "pp", "dp", "distributedOptimizer", "vocabMultiple"}
