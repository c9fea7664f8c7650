"""docker/cpu-demo.yaml is the local demo's configuration (configs/demo-cpu.yaml) with container
paths: the containerised demo learns as the local one does only if the numbers are the same."""

from __future__ import annotations

import math
from typing import Any

import pytest
import yaml

from tests.unit.deploy import stack

LOCAL = stack.ROOT / "configs" / "demo-cpu.yaml"
CONTAINERS = stack.DOCKER / "cpu-demo.yaml"

# What decides learning; paths, URLs, ports and the local launcher differ on purpose.
SAME = [
    "run.groups_per_step",
    "run.group_size",
    "run.max_steps",
    "bus.max_backlog",
    "inference.engine",
    "orchestrator.search.topk",
    "orchestrator.mode",
    "orchestrator.data.seed",
    "orchestrator.rollout",
    "orchestrator.reward",
    "trainer.model.dtype",
    "trainer.optim",
    "trainer.loss",
    "trainer.checkpoint.every_steps",
    "trainer.weight_push.mode",
    "trainer.weight_push.backend",
    "trainer.weight_push.every_steps",
]


def _get(data: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        data = data[key]
    return data


@pytest.mark.parametrize("key", SAME)
def test_training_numbers_equal_the_local_demo(key: str) -> None:
    local, ours = yaml.safe_load(LOCAL.read_text()), yaml.safe_load(CONTAINERS.read_text())
    assert _get(ours, key) == _get(local, key)


def test_epochs_cover_every_step() -> None:
    """What run_demo computes: enough passes over the training questions for run.max_steps."""
    from demos.run import DemoConfig
    from demos.world import generate_world

    cfg = stack.load_with_env({}, CONTAINERS)
    n_train = len(generate_world(0, n_people=DemoConfig().n_people).split("train"))
    want = math.ceil(cfg.run.max_steps * cfg.run.groups_per_step / n_train)
    assert cfg.orchestrator.epochs == want


def test_the_config_loads_with_container_paths() -> None:
    cfg = stack.load_with_env({}, CONTAINERS)
    assert cfg.trainer.model.device == "cpu" and cfg.inference.torch_engine.device == "cpu"
    assert cfg.orchestrator.data.train_path == "/data/train.jsonl"
    assert cfg.trainer.checkpoint.export_dir.startswith("/runs/")
