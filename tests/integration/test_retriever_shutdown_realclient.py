"""A retriever stopped the way supervisors stop it (SIGTERM to its process group) exits 0 and
leaves nothing behind: its encoder child used to die of that SIGTERM mid-life, and Python's
resource tracker then reported "1 leaked semaphore objects to clean up at shutdown"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from harness import synthetic
from searchr1.redis_server import free_port


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.dense_index(tmp_path_factory.mktemp("dense"), 40)


@pytest.mark.slow  # over 10 s: CI's slow phase (issue 45)
def test_a_group_sigterm_is_a_clean_exit_with_no_leak_report(index_dir: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "stack.cli", "retriever", "serve", "--index", str(index_dir),
         "--port", str(port), "--grpc-port", "-1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:  # ready: the encoder child is up
            assert proc.poll() is None and time.monotonic() < deadline, "retriever not ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        resp = httpx.post(f"http://127.0.0.1:{port}/retrieve", json={"queries": ["q"], "topk": 1})
        assert resp.status_code == 200
        os.killpg(proc.pid, signal.SIGTERM)
        # EOF on stderr: every process of the group (the resource tracker too) has ended.
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "leaked" not in err, err[-3000:]
