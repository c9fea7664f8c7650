"""CLI errors name the offending field and exit 2 (before any model is loaded)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", "inference", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_without_model_names_the_field() -> None:
    done = run("serve", "--engine", "torch")
    assert done.returncode == 2 and "inference.model_path" in done.stderr


def test_serve_with_missing_directory(tmp_path: Path) -> None:
    done = run("serve", "--model", str(tmp_path / "nope"))
    assert done.returncode == 2 and "is not a directory" in done.stderr


def test_replicas_need_sglang(tmp_path: Path) -> None:
    done = run("serve", "--model", str(tmp_path), "--replicas", "2")
    assert done.returncode == 2 and "--engine sglang" in done.stderr


def test_push_weights_without_checkpoint(tmp_path: Path) -> None:
    done = run("push-weights", str(tmp_path), "--engine-url", "http://x", "--master-port", "1")
    assert done.returncode == 2 and "safetensors" in done.stderr
