"""bench/pipeline.py end to end on its tiny shape: real orchestrator, bus and trainer processes
against the simulated engines, retriever and trainer GPUs, sync and async; it prints its last
line with every key and sane values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from searchr1.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
KEYS = (
    "sync_step_s", "async_step_s", "speedup", "engine_busy", "trainer_busy", "ideal_step_s",
    "efficiency",
)  # fmt: skip


@pytest.mark.slow
def test_the_pipeline_bench_runs_a_tiny_shape(redis_server: RedisServer) -> None:
    cmd = [sys.executable, "-m", "bench.pipeline", "--shape", "tiny", "--steps", "4",
           "--warmup", "1", "--modes", "sync", "async1", "--redis-url", redis_server.url,
           "--timeout-s", "240"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = dict(kv.split("=") for kv in out.stdout.strip().splitlines()[-1].split())
    assert all(k in last for k in KEYS)
    values = {k: float(last[k]) for k in KEYS}
    assert values["sync_step_s"] > 0 and values["async_step_s"] > 0
    assert 0 < values["engine_busy"] <= 1.05 and 0 < values["trainer_busy"] <= 1.05
    assert 0 < values["efficiency"] <= 1.2
