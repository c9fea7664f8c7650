"""`searchr1 inference push-weights` as a user runs it, against engines that refuse to join.

Every refusal (401: a wrong token, 404: a router or a wrong URL, a closed port) must end the
process with exit 1 and the engine's message: it used to abort with SIGABRT (exit 134) and a
C++ TCPStore trace, because the rendezvous server was torn down under the rank-0 thread still
waiting in it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from searchr1.redis_server import free_port
from tests.support.engines import Target, engine_server

TOKEN = "push-realclient-token"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Target]:
    with engine_server("torch", tiny_model_dir, admin_token=TOKEN) as t:
        yield t


def push(checkpoint: Path, url: str, token: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", "inference", "push-weights", str(checkpoint),
         "--engine-url", url, "--master-port", str(free_port())],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "SEARCHR1_ADMIN_TOKEN": token},
    )  # fmt: skip


def assert_clean_failure(done: subprocess.CompletedProcess[str], message: str) -> None:
    assert done.returncode == 1, done.stderr[-3000:]
    assert message in done.stderr
    assert "terminate called" not in done.stderr and "TCPStore" not in done.stderr


def test_a_wrong_token_exits_1_with_the_engines_message(
    server: Target, tiny_model_dir: Path
) -> None:
    done = push(tiny_model_dir, server.url, "not-the-token")
    assert_clean_failure(done, "/init_weights_update_group: HTTP 401")


def test_a_missing_route_exits_1_with_the_404(server: Target, tiny_model_dir: Path) -> None:
    # What sglang-router answers: it has no weight routes.
    done = push(tiny_model_dir, f"{server.url}/no-such-prefix", TOKEN)
    assert_clean_failure(done, "/init_weights_update_group: HTTP 404")


def test_an_engine_that_is_down_exits_1(tiny_model_dir: Path) -> None:
    done = push(tiny_model_dir, f"http://127.0.0.1:{free_port()}", TOKEN)
    assert_clean_failure(done, "/init_weights_update_group: ConnectError")
