"""A service process built on searchr1.service: SIGTERM finishes in-flight work, exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from searchr1.redis_server import free_port


def wait_ready(url: str, proc: subprocess.Popen[str], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(url)


@pytest.fixture
def service() -> Iterator[tuple[str, int]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.slow_service", str(port)],
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        yield "127.0.0.1", port
    finally:
        proc.kill()
        proc.wait(10)


def read_status(sock: socket.socket, timeout_s: float = 10) -> int:
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


def test_a_declared_oversized_body_is_refused_before_it_is_sent(service) -> None:  # type: ignore[no-untyped-def]
    with socket.create_connection(service) as sock:
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 104857600\r\n\r\n"
        )
        # Not one body byte sent: the answer must not wait for the 100 MiB.
        assert read_status(sock, timeout_s=5) == 413


def test_a_chunked_body_is_cut_off_at_the_limit_while_streaming(service) -> None:  # type: ignore[no-untyped-def]
    # No Content-Length: the server can only count. It must answer 413 once the bytes cross
    # the default 8 MiB and close the connection, long before the 256 MiB this client would send.
    chunk = b"x" * (1 << 20)
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    sent: list[int] = []
    with socket.create_connection(service) as sock:
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )

        def send_all() -> None:
            try:
                for _ in range(256):
                    sock.sendall(framed)
                    sent.append(1)
            except OSError:  # the server answered and closed the connection
                pass

        sender = threading.Thread(target=send_all, daemon=True)
        sender.start()
        assert read_status(sock, timeout_s=30) == 413
        sender.join(10)
    assert len(sent) < 64, len(sent)  # 8 MiB read, plus what the socket buffers held


def test_sigterm_lets_in_flight_requests_finish_then_exits_zero() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.slow_service", str(port)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        wait_ready(url, proc)
        result: dict[str, object] = {}

        def slow_call() -> None:
            r = httpx.get(f"{url}/slow", params={"seconds": 1.5}, timeout=10)
            result["status"], result["body"] = r.status_code, r.json()

        t = threading.Thread(target=slow_call)
        t.start()
        time.sleep(0.4)  # the request is in flight
        proc.send_signal(signal.SIGTERM)
        t.join(10)
        assert result == {"status": 200, "body": {"slept": 1.5}}
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
    messages = [e["msg"] for e in logs]
    assert "handed back in-flight work" in messages
    assert messages.index("handed back in-flight work") < messages.index("stopped")
    assert all(e["service"] == "slow_service" for e in logs)
