""".ci/run's phases, with `python3 dev.py` replaced by a script: a failing test phase stops the
`prepare` build running beside it, everything that build started included."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.support.processes import alive

ROOT = Path(__file__).resolve().parents[2]

# Stands in for `python3 dev.py PHASE`: prepare starts a long child (as pip or docker build
# would) and waits on it; test fails after prepare's child is up.
FAKE_PYTHON = """#!/usr/bin/env bash
case "$2" in
  prepare) sleep 300 & echo $! > "$CI_TEST_DIR/grandchild"; wait ;;
  test) for _ in $(seq 100); do [ -s "$CI_TEST_DIR/grandchild" ] && break; sleep 0.05; done
        exit 1 ;;
  *) echo "phase $2 ran" >> "$CI_TEST_DIR/ran" ;;
esac
"""


def test_a_failing_test_phase_stops_prepare_and_what_it_started(tmp_path: Path) -> None:
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CI_TEST_DIR": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, timeout=60
    )
    assert proc.returncode != 0
    assert not (tmp_path / "ran").exists()  # nothing after the failed phase
    grandchild = int((tmp_path / "grandchild").read_text())
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not alive(grandchild), "prepare's child outlived .ci/run"
    finally:
        if alive(grandchild):
            os.kill(grandchild, 9)
