"""Shared fixtures. Services run as real processes; Redis is a real redis-server."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from searchr1.redis_server import RedisServer

# The default suite's longest files (seconds of one worker, `--durations`), started first: on
# two workers (`dev.py test`: xdist, a file at a time, in this order) the quick demo's ~2 min
# used to start last, on one worker while the other had nothing left.
LONGEST_FIRST = (
    "tests/integration/test_demo_quick.py",
    "tests/integration/test_task_local.py",
    "tests/integration/test_trainer_loop.py",
    "tests/integration/test_trainer_engine.py",
    "tests/integration/test_startup_waits.py",
    "tests/integration/test_orchestrator_rollout.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Everything under tests/integration runs services as processes: `-m integration` selects
    # it, `-m "not integration"` gives the fast unit suite.
    for item in items:
        if item.nodeid.startswith("tests/integration/"):
            item.add_marker(pytest.mark.integration)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


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
