"""Fault counters are exported at 0 from start-up for their known labels, so a dashboard panel
over `rate(...)` shows 0 on a healthy run instead of "No data" until the first fault."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]


def exported(name: str, text: str | None = None, **labels: str) -> float | None:
    """The value of the sample `name{labels}` in /metrics text (default: this process's
    registry, where other tests may have counted faults: only the sample's presence is
    start-up's there)."""
    text = generate_latest(REGISTRY).decode() if text is None else text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


@pytest.fixture(scope="module")
def at_start_up() -> str:
    """/metrics text of a fresh process that imported the services' metric modules: what a
    service exports before its first fault, whatever this test process counted already."""
    code = (
        "import trainer.metrics, orchestrator.metrics, searchr1.bus\n"
        "from prometheus_client import REGISTRY, generate_latest\n"
        "print(generate_latest(REGISTRY).decode())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("stage", ["train_step", "weight_push", "engine_release"])
def test_trainer_errors(stage: str, at_start_up: str) -> None:
    assert exported("searchr1_trainer_errors_total", at_start_up, stage=stage) == 0.0


@pytest.mark.parametrize("reason", ["already_published", "stale", "error", "filtered", "surplus"])
def test_rollout_groups_skipped(reason: str, at_start_up: str) -> None:
    assert exported("searchr1_rollout_groups_skipped_total", at_start_up, reason=reason) == 0.0


@pytest.mark.parametrize(
    "error", ["CircuitOpen", "TimeoutError", "RetrieverUnavailable", "RetrieverBadRequest"]
)
def test_search_failures(error: str, at_start_up: str) -> None:
    assert exported("searchr1_search_failures_total", at_start_up, error=error) == 0.0


@pytest.mark.parametrize(
    "reason",
    [
        "missing_data",
        "bad_version",
        "unknown_version",
        "undecodable",
        "max_deliveries",
        "incomplete_group",
        "train_error",
    ],
)
def test_bus_dead_letters(reason: str, at_start_up: str) -> None:
    assert exported("searchr1_bus_dead_letters_total", at_start_up, reason=reason) == 0.0


class _FakeRedis:
    """Enough of a client for constructors: nothing is sent."""

    def register_script(self, script: str) -> Any:
        return None


def _ops_called(path: str) -> set[str]:
    """The op names a module passes to its Redis retry policy (`_retrying` / `call` /
    `_call` with a string literal)."""
    tree = ast.parse((ROOT / path).read_text())
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("call", "_retrying", "_call")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    }


def test_redis_retries_of_the_bus() -> None:
    from searchr1.bus import TrajectoryBus
    from searchr1.sections import BusConfig

    TrajectoryBus(_FakeRedis(), BusConfig())
    from searchr1.bus import REDIS_OPS

    ops = _ops_called("searchr1/bus.py")
    assert ops == set(REDIS_OPS)
    assert ops  # the scan finds the calls
    for op in ops:
        assert exported("searchr1_redis_retries_total", component="bus", op=op) is not None, op


def test_redis_retries_of_the_lease_and_the_run_markers() -> None:
    from orchestrator.markers import REDIS_OPS, RunMarkers
    from searchr1.lease import RedisLease
    from searchr1.redis_retry import RedisRetry

    RedisLease(_FakeRedis(), "k", ttl_s=5.0)
    assert exported("searchr1_redis_retries_total", component="lease", op="renew") is not None
    RunMarkers(_FakeRedis(), "p", RedisRetry("orchestrator", 5.0))
    assert _ops_called("orchestrator/markers.py") == set(REDIS_OPS)
    for op in REDIS_OPS:
        assert exported("searchr1_redis_retries_total", component="orchestrator", op=op) is not None


def test_redis_retries_of_the_step_claims() -> None:
    from orchestrator.config import PartitionConfig
    from orchestrator.partition import REDIS_OPS, StepClaims
    from searchr1.redis_retry import RedisRetry

    StepClaims(_FakeRedis(), "p", PartitionConfig(), RedisRetry("orchestrator", 5.0), max_groups=1)
    assert _ops_called("orchestrator/partition.py") == set(REDIS_OPS)
    for op in REDIS_OPS:
        assert exported("searchr1_redis_retries_total", component="orchestrator", op=op) is not None
