"""sglang-router 0.3.2 serves its Prometheus metrics on 0.0.0.0:29000 unless told otherwise,
whatever `--host` says; our launcher binds them where the router itself listens (the configured
`inference.http.host`, loopback by default), as the chart does with its own metrics host
(issue 33). tests/integration/test_prometheus_router.py checks a real router's sockets."""

from __future__ import annotations

import pytest

from inference.config import InferenceConfig
from inference.sglang_launcher import plan


def router_argv(http: dict[str, object]) -> list[str]:
    cfg = InferenceConfig.model_validate({"model_path": "/m", "http": http})
    argv, _ = plan(cfg, replicas=2)["router"]
    return argv


@pytest.mark.parametrize("host", [None, "127.0.0.1", "0.0.0.0"])
def test_the_routers_metrics_listen_where_the_router_does(host: str | None) -> None:
    argv = router_argv({"port": 30000} | ({"host": host} if host else {}))
    assert argv[argv.index("--prometheus-host") + 1] == argv[argv.index("--host") + 1]
    assert argv[argv.index("--prometheus-host") + 1] == (host or "127.0.0.1")
