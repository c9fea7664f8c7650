"""Shared fixtures. Services run as real processes; Redis is a real redis-server."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from searchr1.redis_server import RedisServer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Everything under tests/integration runs services as processes: `-m integration` selects
    # it, `-m "not integration"` gives the fast unit suite.
    for item in items:
        if item.nodeid.startswith("tests/integration/"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:  # type: ignore[no-untyped-def]
    """A fresh redis-server (AOF on, appendfsync always) on a free loopback port."""
    server = RedisServer(data_dir=tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny random Qwen2 model + tokenizer (Hugging Face directory), built offline once."""
    from inference.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def seed1_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The tiny model's twin from seed 1: other weights, same shapes (a weight update)."""
    from inference.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("seed1"), seed=1)
