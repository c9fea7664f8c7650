"""`searchr1 orchestrator run` as a process: SIGTERM stops it gracefully with exit status 0,
as every other service (searchr1.service.exit_cleanly_after_shutdown); it exited 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from searchr1.redis_server import RedisServer, free_port


def wait_healthy(url: str, proc: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def test_sigterm_while_waiting_for_the_engine_exits_zero(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    rows = tmp_path / "rows.jsonl"
    row = {
        "prompt": [{"role": "user", "content": "q"}],
        "reward_model": {"ground_truth": {"target": ["a"]}},
    }
    rows.write_text("".join(json.dumps(row) + "\n" for _ in range(64)))
    cfg = tmp_path / "c.yaml"
    settings = {
        "redis": {"url": redis_server.url},
        "run": {"max_steps": 1},
        # Nothing listens there: the loop waits for the engine while the HTTP side is up.
        "engines": {"urls": [f"http://127.0.0.1:{free_port()}"]},
        "orchestrator": {"data": {"train_path": str(rows)}},
    }
    cfg.write_text(yaml.safe_dump(settings))
    port = free_port()
    cmd = ["orchestrator", "run", "--config", str(cfg), "--port", str(port)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "stack.cli", *cmd],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        assert code == 0, proc.stderr.read() if proc.stderr else code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
