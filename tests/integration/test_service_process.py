"""A service process built on searchr1.service: SIGTERM finishes in-flight work, exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from searchr1.redis_server import free_port


def wait_ready(url: str, proc: subprocess.Popen[str], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(url)


def test_sigterm_lets_in_flight_requests_finish_then_exits_zero() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.slow_service", str(port)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        wait_ready(url, proc)
        result: dict[str, object] = {}

        def slow_call() -> None:
            r = httpx.get(f"{url}/slow", params={"seconds": 1.5}, timeout=10)
            result["status"], result["body"] = r.status_code, r.json()

        t = threading.Thread(target=slow_call)
        t.start()
        time.sleep(0.4)  # the request is in flight
        proc.send_signal(signal.SIGTERM)
        t.join(10)
        assert result == {"status": 200, "body": {"slept": 1.5}}
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
    messages = [e["msg"] for e in logs]
    assert "handed back in-flight work" in messages
    assert messages.index("handed back in-flight work") < messages.index("stopped")
    assert all(e["service"] == "slow_service" for e in logs)
