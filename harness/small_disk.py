"""A directory on a small filesystem of its own (tmpfs; mounting needs root), so it can fill up:
a full disk for chaos (`bench/chaos.py`'s `disk_full:*`) and for tests (a real ENOSPC)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path


class SmallDisk:
    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = path
        self.size_bytes = size_bytes

    def _mount(self, *args: str) -> None:
        proc = subprocess.run(["mount", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"cannot mount a tmpfs at {self.path}: {proc.stderr.strip()}")

    def mount(self) -> SmallDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        self._mount("-t", "tmpfs", "-o", f"size={self.size_bytes}", "tmpfs", str(self.path))
        return self

    def fill_for(self, seconds: float) -> None:
        """No room left for `seconds`: the tmpfs shrunk to what it holds, then restored."""
        used = shutil.disk_usage(self.path).used
        self._mount("-o", f"remount,size={used + 4096}", str(self.path))
        try:
            time.sleep(seconds)
        finally:
            self._mount("-o", f"remount,size={self.size_bytes}", str(self.path))

    def unmount(self) -> None:
        if os.path.ismount(self.path):
            subprocess.run(["umount", "-l", str(self.path)], check=False)


def fill(directory: Path) -> Path:
    """Take all the room left where `directory` is: a file written until ENOSPC."""
    filler = directory / "filler"
    with contextlib.suppress(OSError), filler.open("wb") as f:
        while True:
            f.write(b"\0" * 2**16)
            f.flush()
    return filler
