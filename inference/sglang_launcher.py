"""`searchr1 inference serve --engine sglang`: run and supervise SGLang (and sglang-router).

Our config maps onto `python -m sglang.launch_server` flags (model path, tensor parallel size,
memory fraction, context length, host, port, ...). With `--replicas N` the N servers listen on
`port+1 .. port+N` on loopback and `python -m sglang_router.launch_router` listens on the
configured host/port in front of them, so clients see one base URL either way.

The admin token (`SEARCHR1_ADMIN_TOKEN`) becomes SGLang's `--admin-api-key`, which guards the
weight-update and other admin routes but not `/generate` (`--api-key` would guard every route).
It reaches SGLang through a private `--config` YAML file, not the command line, so it does not
show in the process list.

Supervision: a child that exits is restarted after `restart_backoff_s` (doubling, capped at
60 s); after `max_restarts` failures in a row (a child that ran 5 minutes resets the count) the
launcher stops everything and exits 1. SIGTERM/SIGINT stop the children (SIGTERM, then SIGKILL
after `http.graceful_shutdown_s`) and exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.config import InferenceConfig
from searchr1.service import check_exposure

log = logging.getLogger(__name__)

HEALTHY_RUN_S = 300.0


def sglang_command(
    cfg: InferenceConfig, *, host: str, port: int, secrets_file: Path | None = None
) -> list[str]:
    s = cfg.sglang
    assert cfg.model_path, "model_path is validated by the CLI"
    cmd = [
        s.python, "-m", "sglang.launch_server",
        "--model-path", cfg.model_path,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(s.tp_size),
        "--dtype", s.dtype,
        "--enable-metrics",  # its Prometheus /metrics, like every service of ours
    ]  # fmt: skip
    if secrets_file is not None:
        cmd += ["--config", str(secrets_file)]
    optional = {
        "--mem-fraction-static": s.mem_fraction_static,
        "--context-length": s.context_length,
        "--device": s.device,
        "--attention-backend": s.attention_backend,
        "--max-total-tokens": s.max_total_tokens,
    }
    for flag, value in optional.items():
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + list(s.extra_args)


def router_command(cfg: InferenceConfig, worker_urls: list[str]) -> list[str]:
    s = cfg.sglang
    cmd = [
        s.router_python or s.python, "-m", "sglang_router.launch_router",
        "--worker-urls", *worker_urls,
        "--host", cfg.http.host,
        "--port", str(cfg.http.port),
        # Its metrics server binds 0.0.0.0 by default, whatever --host says: where it listens.
        "--prometheus-host", cfg.http.host,
        "--policy", s.router_policy,
    ]  # fmt: skip
    if s.router_policy == "manual":
        cmd += ["--assignment-mode", s.router_assignment_mode]
    return cmd


def cpu_settings(python: str) -> dict[str, Any]:
    """The `inference.sglang` fields that make SGLang 0.5.21 serve on a CPU machine (the recipe
    of `python3 dev.py sglang`): float32 so that its logprobs match a float32 trainer."""
    return {
        "python": python,
        "device": "cpu",
        "attention_backend": "torch_native",
        "max_total_tokens": 65536,
        "dtype": "float32",
        "env": {"SGLANG_USE_CPU_ENGINE": "1"},
    }


def write_secrets_file(directory: Path, admin_token: str) -> Path:
    """SGLang's `--config` YAML holding the admin key, readable by this user only."""
    import yaml

    path = directory / "sglang-secrets.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump({"admin-api-key": admin_token}, f)
    return path


def plan(
    cfg: InferenceConfig, replicas: int, secrets_file: Path | None = None
) -> dict[str, tuple[list[str], str]]:
    """Child name -> (argv, health URL)."""
    if replicas == 1:
        argv = sglang_command(
            cfg, host=cfg.http.host, port=cfg.http.port, secrets_file=secrets_file
        )
        return {"sglang": (argv, _health_url(cfg.http.host, cfg.http.port))}
    ports = [cfg.http.port + i + 1 for i in range(replicas)]
    children = {
        f"sglang-{i}": (
            sglang_command(cfg, host="127.0.0.1", port=p, secrets_file=secrets_file),
            _health_url("127.0.0.1", p),
        )
        for i, p in enumerate(ports)
    }
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    children["router"] = (router_command(cfg, urls), _health_url(cfg.http.host, cfg.http.port))
    return children


def _health_url(host: str, port: int) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{host}:{port}/health"


@dataclass
class _Child:
    name: str
    argv: list[str]
    health_url: str
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    healthy: bool = False
    failures: int = 0
    restart_at: float = field(default=0.0)

    def start(self) -> None:
        log.info("starting", extra={"child": self.name, "argv": " ".join(self.argv)})
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env})
        self.started = time.monotonic()
        self.healthy = False

    def probe(self) -> bool:
        import httpx

        try:
            return httpx.get(self.health_url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False


class Supervisor:
    def __init__(self, children: dict[str, tuple[list[str], str]], cfg: InferenceConfig) -> None:
        self.children = [
            _Child(n, argv, url, dict(cfg.sglang.env)) for n, (argv, url) in children.items()
        ]
        self.start_timeout_s = cfg.sglang.start_timeout_s
        self.backoff_s = cfg.sglang.restart_backoff_s
        self.max_restarts = cfg.sglang.max_restarts
        self.grace_s = cfg.http.graceful_shutdown_s
        self._stop = False

    def _on_signal(self, signum: int, _frame: object) -> None:
        log.info("stopping", extra={"signal": signum})
        self._stop = True

    def run(self, poll_s: float = 0.2) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            for c in self.children:
                c.start()
            while not self._stop:
                if not self._check():
                    return 1
                time.sleep(poll_s)
            return 0
        finally:
            self._stop_all()

    def _check(self) -> bool:
        now = time.monotonic()
        for c in self.children:
            assert c.proc is not None
            code = c.proc.poll()
            if code is None and not c.healthy and c.restart_at == 0.0:
                c.healthy = c.probe()
                if c.healthy:
                    log.info("healthy", extra={"child": c.name, "after_s": round(now - c.started)})
                elif now - c.started > self.start_timeout_s:
                    log.warning("not healthy in time; killing", extra={"child": c.name})
                    c.proc.kill()
                    code = c.proc.wait()
            if code is None:
                if c.failures and now - c.started > HEALTHY_RUN_S:
                    c.failures = 0
                continue
            if c.restart_at == 0.0:
                c.failures += 1
                if c.failures > self.max_restarts:
                    log.error("giving up", extra={"child": c.name, "failures": c.failures})
                    return False
                delay = min(60.0, self.backoff_s * 2 ** (c.failures - 1))
                log.warning(
                    "child exited; restarting",
                    extra={"child": c.name, "code": code, "in_s": delay},
                )
                c.restart_at = now + delay
            elif now >= c.restart_at:
                c.restart_at = 0.0
                c.start()
        return True

    def _stop_all(self) -> None:
        live = [c.proc for c in self.children if c.proc and c.proc.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + self.grace_s
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_sglang(cfg: InferenceConfig, *, replicas: int = 1, admin_token: str | None = None) -> int:
    """Run SGLang (behind sglang-router when replicas > 1) until SIGTERM; the exit status.
    Without an admin token SGLang's admin routes (weight updates included) are open, so that
    is refused beyond loopback unless `http.auth: none` (`check_exposure`)."""
    check_exposure(cfg.http, token_set=admin_token is not None)
    with tempfile.TemporaryDirectory(prefix="searchr1-sglang-") as tmp:
        secrets_file = write_secrets_file(Path(tmp), admin_token) if admin_token else None
        if admin_token is None:
            log.warning("no SEARCHR1_ADMIN_TOKEN: SGLang's weight-update routes are open")
        return Supervisor(plan(cfg, replicas, secrets_file), cfg).run()
