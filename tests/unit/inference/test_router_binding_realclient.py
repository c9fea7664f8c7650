"""sglang-router listens on 0.0.0.0 unless told otherwise; our launcher always tells it: the
configured `inference.http.host`, loopback by default (issue 33)."""

from __future__ import annotations

from inference.config import InferenceConfig
from inference.sglang_launcher import plan


def router_host(http: dict[str, object]) -> str:
    cfg = InferenceConfig.model_validate({"model_path": "/m", "http": http})
    argv, _ = plan(cfg, replicas=2)["router"]
    return argv[argv.index("--host") + 1]


def test_the_router_binds_loopback_unless_the_config_says_otherwise() -> None:
    assert router_host({"port": 30000}) == "127.0.0.1"
    assert router_host({"host": "0.0.0.0", "port": 30000}) == "0.0.0.0"
