"""A service refused for listening beyond loopback without a token says so in one line naming
the setting, exit 2: it used to print a traceback of `searchr1.service.InsecureListener`.
`searchr1 retriever serve` has `--host`, like the engine's serve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from searchr1.service import ADMIN_TOKEN_ENV


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV}
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args, "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=120, env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def assert_one_line_refusal(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "InsecureListener" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "http.host is '0.0.0.0'" in errors[0]
    assert ADMIN_TOKEN_ENV in errors[0] and "http.auth: none" in errors[0]


def test_the_retriever_refuses_with_one_line() -> None:
    assert_one_line_refusal(serve("retriever", "serve", "--web", "--grpc-port", "-1"))


@pytest.mark.parametrize("engine", ["torch"])
def test_the_engine_refuses_with_one_line(engine: str, tiny_model_dir: Path) -> None:
    assert_one_line_refusal(
        serve("inference", "serve", "--engine", engine, "--model", str(tiny_model_dir))
    )
