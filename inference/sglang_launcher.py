"""`searchr1 inference serve --engine sglang`: run and supervise SGLang (and sglang-router).

Our config maps onto `python -m sglang.launch_server` flags (model path, tensor parallel size,
memory fraction, context length, host, port, ...). With `--replicas N` the N servers listen on
`port+1 .. port+N` on loopback and `python -m sglang_router.launch_router` listens on the
configured host/port in front of them, so clients see one base URL either way.

The admin token (`SEARCHR1_ADMIN_TOKEN`) becomes SGLang's `--admin-api-key`, which guards the
weight-update and other admin routes but not `/generate` (`--api-key` would guard every route).
It reaches SGLang through a private `--config` YAML file, not the command line, so it does not
show in the process list.

Supervision is `searchr1.supervisor`'s, as in `searchr1 local`: every child starts at once, in a
process group of its own, its output ours (the container's log), `OMP_NUM_THREADS` 1 unless
`sglang.env` sets it; one that exits, or is not
healthy within `start_timeout_s`, is restarted after `restart_backoff_s` (doubling for quick
deaths, capped at 60 s); after `max_restarts` deaths in a row (a child healthy for 5 minutes
starts its count again) the launcher stops everything and exits 1. SIGTERM/SIGINT stop the
children (SIGTERM to each group, then SIGKILL after `http.graceful_shutdown_s`) and exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

from inference.config import InferenceConfig
from searchr1.service import check_exposure
from searchr1.supervisor import ChildFailed, RestartPolicy, ServiceSpec, Supervisor

log = logging.getLogger(__name__)

MAX_RESTART_DELAY_S = 60.0


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


class _Stopped(Exception):
    """SIGTERM or SIGINT: stop the children and exit 0."""


def _stop_on_signal(signum: int, _frame: object) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # one stop: a second signal must not cut it short
    raise _Stopped(signal.Signals(signum).name)


def supervise(children: dict[str, tuple[list[str], str]], cfg: InferenceConfig) -> int:
    """Run the children under `searchr1.supervisor` until a signal (0) or a child gives up (1)."""
    s = cfg.sglang
    sup = Supervisor([], None, grace_s=cfg.http.graceful_shutdown_s)
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGINT, _stop_on_signal)
    try:
        for name, (argv, health_url) in children.items():
            sup.add(
                ServiceSpec(
                    name,
                    argv,
                    ready_url=health_url,
                    env=dict(s.env),
                    restart=RestartPolicy.ON_FAILURE,
                    max_restarts=s.max_restarts,
                    first_restart_delay_s=s.restart_backoff_s,
                    max_restart_delay_s=MAX_RESTART_DELAY_S,
                    ready_timeout_s=s.start_timeout_s,
                )
            )
        sup.run()
    except _Stopped as stop:
        log.info("stopping", extra={"signal": str(stop)})
    except ChildFailed as failed:
        log.error("giving up", extra={"child": failed.name, "reason": failed.reason})
        return 1
    finally:
        sup.stop()  # also when a signal came before every child was added
    return 0


def run_sglang(cfg: InferenceConfig, *, replicas: int = 1, admin_token: str | None = None) -> int:
    """Run SGLang (behind sglang-router when replicas > 1) until SIGTERM; the exit status.
    Without an admin token SGLang's admin routes (weight updates included) are open, so that
    is refused beyond loopback unless `http.auth: none` (`check_exposure`)."""
    check_exposure(cfg.http, token_set=admin_token is not None)
    with tempfile.TemporaryDirectory(prefix="searchr1-sglang-") as tmp:
        secrets_file = write_secrets_file(Path(tmp), admin_token) if admin_token else None
        if admin_token is None:
            log.warning("no SEARCHR1_ADMIN_TOKEN: SGLang's weight-update routes are open")
        return supervise(plan(cfg, replicas, secrets_file), cfg)
