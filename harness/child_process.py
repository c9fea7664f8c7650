"""Waiting for a child server that a bench started itself (not a `ServiceProcess`)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120) -> None:
    """Return once `url` answers 200; raise with the log's tail if `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not up after {timeout_s}s")
