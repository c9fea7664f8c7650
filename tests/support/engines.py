"""Inference servers for tests: our reference engine, or a real SGLang (the `sglang` marker).

Tests that speak SGLang's protocol take a `target` from `engine_target(...)`, parametrized over
both engines, so one test body checks both servers. The SGLang twin runs only under
`-m sglang` (`python3 dev.py sglang` sets `SEARCHR1_SGLANG_PYTHON` to the interpreter of its
environment and runs them); there it fails, never skips, when SGLang is missing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.inference_server import InferenceServerProcess

ENGINES = ["torch", pytest.param("sglang", marks=pytest.mark.sglang)]
SGLANG_PYTHON_ENV = "SEARCHR1_SGLANG_PYTHON"


@dataclass(frozen=True)
class Target:
    url: str
    model_dir: Path
    token: str | None
    engine: str  # "torch" | "sglang"

    @property
    def is_sglang(self) -> bool:
        return self.engine == "sglang"


def sglang_python() -> str:
    python = os.environ.get(SGLANG_PYTHON_ENV)
    if not python or not Path(python).exists():
        pytest.fail(
            f"{SGLANG_PYTHON_ENV} is not set to SGLang's interpreter: run the sglang tests "
            "with `python3 dev.py sglang`"
        )
    return python


@contextmanager
def engine_server(
    engine: str,
    model_dir: Path,
    *,
    admin_token: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Target]:
    """A served engine on `model_dir` as a real process, stopped on exit."""
    kwargs: dict = {"env": env}
    if engine == "sglang":
        kwargs |= {"engine": "sglang", "sglang_python": sglang_python(), "ready_timeout_s": 300}
    with InferenceServerProcess(model_dir, admin_token=admin_token, **kwargs) as server:
        yield Target(server.url, Path(model_dir), admin_token, engine)
