"""Run `searchr1 inference serve` as a child process: for tests, benchmarks and the demo.

    with InferenceServerProcess(model_dir) as server:
        client = InferenceClient(server.url)

The process gets OMP_NUM_THREADS=1 (several services share a few cores) and a free loopback
port; `start()` returns once `/ready` answers 200; `stop()` sends SIGTERM (graceful).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from searchr1.redis_server import free_port


class InferenceServerProcess:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        port: int | None = None,
        admin_token: str | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.port = port or free_port()
        self.admin_token = admin_token
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        # Closed in __exit__; the server writes into it for its whole life.
        self._log = tempfile.NamedTemporaryFile(prefix="searchr1-inference-", suffix=".log")  # noqa: SIM115

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        exe = shutil.which("searchr1", path=str(Path(sys.executable).parent))
        base = [exe] if exe else [sys.executable, "-m", "searchr1.cli"]
        return [
            *base, "inference", "serve",
            "--engine", "torch", "--model", self.model_dir, "--port", str(self.port),
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 120.0) -> InferenceServerProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.update(self.env)
        if self.admin_token:
            env["SEARCHR1_ADMIN_TOKEN"] = self.admin_token
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"inference server exited with {self.proc.returncode}: {self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"inference server not ready after {timeout_s}s: {self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = Path(self._log.name).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def __enter__(self) -> InferenceServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()
