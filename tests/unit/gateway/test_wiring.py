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
