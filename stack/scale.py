"""Scaling engines during a `searchr1 local` run: the launcher's control endpoint and its client.

With `local.control_port` set, the launcher serves (on 127.0.0.1 only) `GET /engines` and
`POST /scale {"engines": N}`, both behind a bearer token: the admin token when one is set
(SEARCHR1_ADMIN_TOKEN), else a random one; the URL and token are written to
`<local.log_dir>/../control.json` (mode 0600), which `searchr1 local scale --engines N` reads.

An engine added this way (`inference-<i>` on `inference.http.port + i`) pulls the current
weights from the trainer's weight store (`trainer.weight_push.store_dir`), becomes ready, and
announces itself; the trainer (its next push) and the orchestrator (within a few seconds) take
it in (`engines.discover`, which the launcher turns on for them). Nobody pauses. Scaling down
stops the engines added last (SIGTERM: an engine withdraws its announcement, finishes its
requests and exits); the `local.inference_replicas` engines started with the run stay.

Requests reach the supervisor through a queue its own loop drains (`apply_pending`, called
every tick): the supervisor is not thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from searchr1.supervisor import ServiceSpec, Supervisor

log = logging.getLogger(__name__)
MAX_ENGINES = 64


def control_file(log_dir: Path) -> Path:
    return Path(log_dir).parent / "control.json"


@dataclass
class _Call:
    engines: int | None  # None: only list them
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict[str, Any] | None = None
    error: str | None = None


class EngineScaler:
    """Adds and retires engines on the launcher's supervisor (its own thread only)."""

    def __init__(
        self, sup: Supervisor, make_spec: Callable[[int], ServiceSpec], *, floor: int, port: int
    ) -> None:
        self.sup = sup
        self.make_spec = make_spec
        self.floor = floor  # the engines the run started with: never retired
        self.port = port
        self.calls: queue.Queue[_Call] = queue.Queue()

    def _engines(self) -> list[tuple[int, str]]:
        """(index, name) of the engines running or starting, retiring ones left out."""
        out = []
        for c in self.sup.children:
            name = c.spec.name
            if c.status == "retiring" or not name.startswith("inference"):
                continue
            index = int(name.rsplit("-", 1)[1]) if "-" in name else 0
            out.append((index, name))
        return sorted(out)

    def describe(self) -> dict[str, Any]:
        status = {c.spec.name: c.status for c in self.sup.children}
        return {
            "engines": [
                {"name": n, "url": f"http://127.0.0.1:{self.port + i}", "status": status[n]}
                for i, n in self._engines()
            ],
            "floor": self.floor,
        }

    def scale(self, n: int) -> dict[str, Any]:
        if not self.floor <= n <= MAX_ENGINES:
            raise ValueError(
                f"engines must be between {self.floor} (local.inference_replicas: the engines "
                f"the run started with stay) and {MAX_ENGINES}, got {n}"
            )
        running = self._engines()
        taken = {i for i, _ in running}
        for i in range(n):
            if i not in taken and len(taken) < n:
                self.sup.add(self.make_spec(i))
                taken.add(i)
                log.info("engine added", extra={"index": i})
        for i, name in reversed(running):
            if len(taken) <= n:
                break
            if i >= self.floor:
                self.sup.retire(name)
                taken.discard(i)
        return self.describe()

    def apply_pending(self) -> None:
        """Serve the queued calls (the launcher's loop, every tick)."""
        while True:
            try:
                call = self.calls.get_nowait()
            except queue.Empty:
                return
            try:
                call.answer = self.describe() if call.engines is None else self.scale(call.engines)
            except Exception as e:  # a refused or failed scale: the caller's answer
                call.error = str(e)
            call.done.set()


class ControlServer:
    """The control endpoint, a daemon thread on 127.0.0.1."""

    def __init__(self, scaler: EngineScaler, port: int, token: str, file: Path) -> None:
        self.scaler, self.token, self.file = scaler, token, file
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> ControlServer:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.url, "token": self.token}, f)
        self._thread.start()
        log.info("control endpoint up", extra={"url": self.url, "file": str(self.file)})
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.file.unlink(missing_ok=True)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:  # our own log lines instead
                return

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                given = self.headers.get("Authorization", "")
                if secrets.compare_digest(given, f"Bearer {server.token}"):
                    return True
                self._send(401, {"error": "a bearer token is required (control.json)"})
                return False

            def _call(self, engines: int | None) -> None:
                call = _Call(engines)
                server.scaler.calls.put(call)
                if not call.done.wait(30):
                    self._send(504, {"error": "the launcher did not answer in 30 s"})
                elif call.error is not None:
                    self._send(400, {"error": call.error})
                else:
                    self._send(200, call.answer or {})

            def do_GET(self) -> None:
                if self.path != "/engines":
                    self._send(404, {"error": "GET /engines or POST /scale"})
                elif self._authorized():
                    self._call(None)

            def do_POST(self) -> None:
                if self.path != "/scale":
                    self._send(404, {"error": "GET /engines or POST /scale"})
                    return
                if not self._authorized():
                    return
                try:
                    size = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(min(size, 4096)) or b"{}")
                    engines = body["engines"]
                    if not isinstance(engines, int) or isinstance(engines, bool):
                        raise ValueError("engines must be an integer")
                except (ValueError, KeyError, TypeError) as e:
                    self._send(400, {"error": f'body must be {{"engines": N}} ({e})'})
                    return
                self._call(engines)

        return Handler


def request_scale(file: Path, engines: int | None, *, timeout_s: float = 40.0) -> dict[str, Any]:
    """The client: POST /scale (or GET /engines for None) to the launcher that wrote `file`."""
    try:
        info = json.loads(Path(file).read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{file}: no running `searchr1 local` with local.control_port set"
        ) from None
    headers = {"Authorization": f"Bearer {info['token']}"}
    with httpx.Client(base_url=info["url"], headers=headers, timeout=timeout_s) as client:
        if engines is None:
            resp = client.get("/engines")
        else:
            resp = client.post("/scale", json={"engines": engines})
    body = resp.json()
    if resp.status_code != 200:
        raise ValueError(body.get("error", resp.text))
    return body
