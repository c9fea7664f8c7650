"""bench/soak.py's short form (slow): the quick demo's stack for 40 s with two faults (a Redis
freeze, an engine pause), every service sampled, every figure fitted and on the last line (~3
min on 2 idle cores). Minutes are too few to tell a leak from a warm-up (`--allow-leaks`): the
verdict's rule is tested on hand-made series in tests/unit/harness/test_soak.py, the soak's runs
are in docs/reliability.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("redis", "retriever", "inference", "orchestrator", "trainer")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_soak_short_form_samples_every_service_and_fits_every_figure(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-P", str(ROOT / "bench" / "soak.py"), "--quick", "--out", str(tmp_path),
        "--duration-s", "40", "--fault-every-s", "12", "--sample-s", "2", "--warmup-s", "10",
        "--kinds", "freeze:redis,pause:inference", "--freeze-s", "4,6",
        "--groups-per-step", "2", "--group-size", "2", "--allow-leaks",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    out = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    values = dict(kv.split("=", 1) for kv in proc.stdout.strip().splitlines()[-1].split())
    figures = [f"{s}_{f}_per_h" for s in SERVICES for f in ("rss_mb", "fds", "threads")]
    figures += [
        "redis_used_memory_mb_per_h",
        "redis_keys_per_h",
        "disk_state_mb_per_h",
        "step_s_per_h",
    ]
    figures += ["stream_searchr1_trajectories_len_per_h"]
    missing = [f for f in figures if f not in values]
    assert not missing, out
    assert list(values)[-1] == "leaks" and int(values["leaks"]) >= 0, out
    assert "fault 1: freeze:redis" in proc.stdout, out  # a sample meets Redis frozen: skipped
    assert "redis keys by family" in proc.stdout, out
    assert "disk_logs_mb_per_h" in values and (tmp_path / "soak_samples.json").exists(), out
