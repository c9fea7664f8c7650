"""The dashboard's "Router (sglang-router)" row against a real sglang-router 0.3.2 scraped by a
real Prometheus (issue 33): the router (from SGLang's environment, so `-m sglang`) in front of
two of our engines, its metrics on their own loopback port (`--prometheus-port`, the chart's
`metrics` port), a few generate calls through it; then every expression of the row has data
through Prometheus's HTTP API, and `promtool check metrics` finds nothing in the router's
output beyond its missing help texts (sglang-router exports none; upstream, not ours).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from harness.inference_server import InferenceServerProcess
from harness.prometheus_server import (
    PROMETHEUS,
    PROMTOOL,
    PrometheusProcess,
    promtool_check_metrics,
)
from inference.config import InferenceConfig
from inference.sglang_launcher import router_command
from searchr1.redis_server import free_port
from searchr1.supervisor import ServiceProcess, ServiceSpec
from tests.support.engines import sglang_python

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s/searchr1/dashboards/searchr1.json"
ROW = "Router (sglang-router)"

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        PROMETHEUS is None or PROMTOOL is None,
        reason="prometheus/promtool not installed (Debian: apt-get install prometheus)",
    ),
]


def router_exprs() -> list[tuple[str, str]]:
    """(panel title, expression) of the router row's panels."""
    out, row = [], None
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        if p["type"] == "row":
            row = p["title"]
        elif row == ROW:
            out += [(p["title"], t["expr"]) for t in p["targets"]]
    return out


@dataclass
class Routed:
    prom: PrometheusProcess
    metrics_url: str
    router_pid: int


def listening(pid: int) -> set[str]:
    """ "address:port" of every TCP socket `pid` listens on (from /proc, IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            raw, port = fields[1].split(":")
            packed = bytes.fromhex(raw)
            # /proc writes each 32-bit word of the address in host (little-endian) order
            packed = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
            out.add(f"{socket.inet_ntop(family, packed)}:{int(port, 16)}")
    return out


@pytest.fixture(scope="module")
def routed(tiny_model_dir: Path) -> Iterator[Routed]:
    port, metrics_port = free_port(), free_port()
    cfg = InferenceConfig.model_validate(
        {"engine": "sglang", "http": {"host": "127.0.0.1", "port": port},
         "sglang": {"router_python": sglang_python(), "router_policy": "round_robin"}}
    )  # fmt: skip
    with (
        InferenceServerProcess(tiny_model_dir) as a,
        InferenceServerProcess(tiny_model_dir) as b,
    ):
        command = router_command(cfg, [a.url, b.url])
        command += ["--prometheus-port", str(metrics_port)]  # its host: the router's (ours)
        spec = ServiceSpec(
            "router", command, ready_url=f"http://127.0.0.1:{port}/health", ready_timeout_s=60
        )
        with (
            ServiceProcess(spec) as router,
            PrometheusProcess({"router": [f"127.0.0.1:{metrics_port}"]}) as prom,
        ):
            for _ in range(4):  # round robin: both engines
                resp = httpx.post(
                    f"http://127.0.0.1:{port}/generate",
                    json={"input_ids": [1, 70, 71], "sampling_params": {"max_new_tokens": 4}},
                    timeout=60,
                )
                assert resp.status_code == 200, resp.text
            # Scraped after the last call, and often enough for rate() over 5 minutes.
            prom.wait_for("sum(smg_router_requests_total) >= 4", bool, timeout_s=60)
            prom.wait_for("count_over_time(up[1m]) >= 3", bool, timeout_s=60)
            yield Routed(prom, f"http://127.0.0.1:{metrics_port}/metrics", router.proc.pid)


def test_the_router_row_is_the_one_checked() -> None:
    assert len(router_exprs()) == 6


@pytest.mark.parametrize(("title", "expr"), router_exprs())
def test_router_expression_has_data(routed: Routed, title: str, expr: str) -> None:
    assert routed.prom.query(expr), f"{title}: `{expr}` is empty (Grafana: No data)"


def test_the_launchers_router_listens_on_loopback_only(routed: Routed) -> None:
    """Our launcher's command line: the proxy and its metrics on the configured host, here
    loopback (sglang-router 0.3.2 put its metrics on 0.0.0.0:29000 unless told otherwise)."""
    found = listening(routed.router_pid)
    assert found and all(a.startswith(("127.0.0.1:", "::1:")) for a in found), found


def test_router_metrics_pass_promtool_but_for_help_texts(routed: Routed) -> None:
    found = promtool_check_metrics(httpx.get(routed.metrics_url, timeout=10).text)
    other = [line for line in found.splitlines() if not line.endswith(" no help text")]
    assert not other, found
