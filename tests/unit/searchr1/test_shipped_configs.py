"""Every config file we ship must load: a stale example is a bug users hit first."""

from __future__ import annotations

from pathlib import Path

import pytest

from stack.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads(path: Path) -> None:
    load_config(path)


def test_there_are_shipped_configs() -> None:
    assert CONFIGS, "configs/ holds no YAML files"
