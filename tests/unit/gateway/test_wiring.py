"""Start-up: a frozen engine is waited for within the deadline, never past it; the served
model's limits come from the engine, else its config.json."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.wiring import model_limits, wait_for_engine


class Frozen:
    """Accepts the call and never answers (SIGSTOP, a stuck device call)."""

    async def get_model_info(self) -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {}


async def test_a_frozen_engine_fails_start_up_at_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"not reachable after 0\.3s"):
        await wait_for_engine(Frozen(), 0.3)  # type: ignore[arg-type]
    assert time.monotonic() - start < 2.0


def test_model_limits_from_the_engine_or_the_model_directory(tmp_path: Path) -> None:
    assert model_limits({"vocab_size": 10, "context_length": 64}, str(tmp_path), []) == (10, 64)
    (tmp_path / "config.json").write_text(
        json.dumps({"vocab_size": 32, "max_position_embeddings": 128})
    )
    assert model_limits({}, str(tmp_path), []) == (32, 128)
    assert model_limits({}, str(tmp_path / "none"), [0, 1, 2]) == (3, None)


def _settings(tmp_path: Path, text: str) -> Any:
    from gateway.config import GatewaySettings
    from searchr1.settings import load_settings

    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return load_settings(GatewaySettings, path)


def test_the_engine_follows_the_stacks_engines_section(tmp_path: Path) -> None:
    """gateway.engine_url left out: the engines section, as the orchestrator reads it (it used
    to stay at http://127.0.0.1:30000 whatever the stack's engines were)."""
    from engine_client.client import InferenceClient
    from engine_client.pool import EnginePool
    from gateway.wiring import make_engine

    one = _settings(tmp_path, "engines: {urls: ['http://e0:9']}\n")
    assert one.gateway.engine_url == "http://e0:9"
    routed = _settings(tmp_path, "engines: {urls: ['http://e0:9'], router_url: 'http://r:1'}\n")
    assert routed.gateway.engine_url == "http://r:1"
    named = _settings(
        tmp_path, "engines: {urls: ['http://e0:9']}\ngateway: {engine_url: 'http://x:2'}\n"
    )
    assert named.gateway.engine_url == "http://x:2"  # named: it wins
    several = _settings(tmp_path, "engines: {urls: ['http://e0:9', 'http://e1:9']}\n")
    assert several.gateway.engine_url is None
    engine = make_engine(several.gateway, several.engines, None)
    assert isinstance(engine, EnginePool)  # keyed by session: its turns stay on one engine
    assert [e.url for e in engine.engines] == ["http://e0:9", "http://e1:9"]
    assert isinstance(make_engine(one.gateway, one.engines, None), InferenceClient)
