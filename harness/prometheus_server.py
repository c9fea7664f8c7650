"""A real Prometheus server (Debian's `prometheus` 2.42) for the tests: a temporary config and
data directory, a free loopback port, scraping the given targets every second and loading the
given rule files; queried through its HTTP API.

    with PrometheusProcess({"searchr1": ["127.0.0.1:8000"]}, rule_files=[...]) as prom:
        prom.wait_for("up", lambda r: len(r) == 1)
        prom.query("searchr1_trainer_step")

`promtool_check_metrics(text)` lints a service's /metrics output the way `promtool check
metrics` does in a scrape pipeline.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from searchr1.redis_server import free_port
from searchr1.supervisor import ServiceProcess, ServiceSpec

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


class PrometheusError(RuntimeError):
    """A query Prometheus answered with an error (bad PromQL, a failed evaluation)."""


class PrometheusProcess(ServiceProcess):
    """`prometheus` with a config scraping `targets` (job -> ["host:port", ...]) every
    `interval` and evaluating `rule_files` at the same interval."""

    def __init__(
        self,
        targets: dict[str, list[str]],
        *,
        rule_files: list[Path] | None = None,
        interval: str = "1s",
        extra_jobs: list[dict[str, Any]] | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        if PROMETHEUS is None:
            raise FileNotFoundError(
                "prometheus is not installed (Debian: apt-get install prometheus)"
            )
        self.port = free_port()
        super().__init__(ServiceSpec("prometheus", []))
        home = self.child.log_path.parent
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in rule_files or []],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": hosts}]}
                for job, hosts in targets.items()
            ]
            + list(extra_jobs or []),
        }
        (home / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.child.spec.command = [
            PROMETHEUS,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.child.spec.ready_url = f"{self.url}/-/ready"
        self.child.spec.ready_timeout_s = ready_timeout_s
        self._http = httpx.Client(base_url=f"{self.url}/api/v1", timeout=10.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._http.close()
        super().close()

    def api(self, path: str, **params: Any) -> Any:
        body = self._http.get(path, params=params).json()
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result vector (at `at`, a Unix time; default now)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("/query", **params)
        return data["result"] if data["resultType"] == "vector" else [data["result"]]

    def wait_for(
        self,
        expr: str,
        done: Callable[[list[dict[str, Any]]], bool],
        *,
        timeout_s: float,
        alive: Callable[[], None] = lambda: None,
    ) -> list[dict[str, Any]]:
        """Query `expr` every 0.5 s until `done(result)`; `alive()` raises if what is being
        waited on has died. TimeoutError (with the last result) after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            alive()
            result = self.query(expr)
            if done(result):
                return result
            time.sleep(0.5)
        raise TimeoutError(f"{expr}: not there after {timeout_s:.0f}s; last result {result}")


def promtool_check_metrics(text: str) -> str:
    """`promtool check metrics` on an exposition text: its complaints ('' when clean)."""
    if PROMTOOL is None:
        raise FileNotFoundError("promtool is not installed (Debian: apt-get install prometheus)")
    out = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    return (out.stdout + out.stderr).strip() if out.returncode else ""
