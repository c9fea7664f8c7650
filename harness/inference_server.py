"""Run `searchr1 inference serve` as a child process: for tests and benchmarks.

    with InferenceServerProcess(model_dir) as server:
        client = InferenceClient(server.url)

A `ServiceProcess` (the supervisor of `searchr1 local`) on a free loopback port: OMP_NUM_THREADS=1
(several services share a few cores), `start()` returns once `/ready` answers 200, `stop()`
sends SIGTERM (graceful) to the process group, and a failure carries the log's last lines.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from inference.config import InferenceConfig
from inference.sglang_launcher import cpu_settings, router_command
from searchr1.redis_server import free_port
from searchr1.supervisor import ServiceProcess, ServiceSpec


class InferenceServerProcess(ServiceProcess):
    """`engine="sglang"` runs a real SGLang through our launcher, with the CPU settings of
    `inference.sglang_launcher.cpu_settings` and the interpreter `sglang_python`."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        port: int | None = None,
        admin_token: str | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 120.0,
        engine: str = "torch",
        sglang_python: str | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.port = port or free_port()
        exe = shutil.which("searchr1", path=str(Path(sys.executable).parent))
        base = [exe] if exe else [sys.executable, "-m", "stack.cli"]
        env = {"TOKENIZERS_PARALLELISM": "false", **(env or {})}
        if engine == "sglang":
            if not sglang_python:
                raise ValueError("engine=sglang needs sglang_python (SGLang's interpreter)")
            self._config_dir = tempfile.TemporaryDirectory(prefix="searchr1-sglang-cfg-")
            config = Path(self._config_dir.name) / "inference.yaml"
            section = {"engine": "sglang", "sglang": cpu_settings(sglang_python)}
            config.write_text(yaml.safe_dump({"inference": section}))
            extra_args = ["--config", str(config), *(extra_args or [])]
        command = [
            *base, "inference", "serve",
            "--engine", engine, "--model", self.model_dir, "--port", str(self.port),
            *(extra_args or []),
        ]  # fmt: skip
        if admin_token:
            env["SEARCHR1_ADMIN_TOKEN"] = admin_token
        spec = ServiceSpec(
            "inference", command, ready_url=f"{self.url}/ready", env=env,
            ready_timeout_s=ready_timeout_s,
        )  # fmt: skip
        super().__init__(spec)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class RouterProcess(ServiceProcess):
    """sglang-router (`python -m sglang_router.launch_router`, with `python` the interpreter
    that has it) in front of `worker_urls`, on a free loopback port, with the command line our
    launcher gives it (`inference.sglang_launcher.router_command`)."""

    def __init__(
        self,
        worker_urls: list[str],
        *,
        python: str,
        policy: str = "manual",
        assignment_mode: str = "min_load",
        port: int | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        self.port = port or free_port()
        cfg = InferenceConfig.model_validate(
            {
                "engine": "sglang",
                "http": {"host": "127.0.0.1", "port": self.port},
                "sglang": {
                    "router_python": python,
                    "router_policy": policy,
                    "router_assignment_mode": assignment_mode,
                },
            }
        )
        spec = ServiceSpec(
            "router",
            router_command(cfg, worker_urls),
            ready_url=f"{self.url}/health",
            ready_timeout_s=ready_timeout_s,
        )
        super().__init__(spec)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
