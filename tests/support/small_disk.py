"""A small tmpfs for a test's real ENOSPC; the test is skipped where mounting is refused."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.small_disk import SmallDisk


@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    disk = SmallDisk(path, size_bytes)
    try:
        disk.mount()
    except RuntimeError as e:
        pytest.skip(str(e))
    try:
        yield path
    finally:
        disk.unmount()
