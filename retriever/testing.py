"""Helpers to run a real retriever server process (tests, benchmarks, other packages' tests).

with RetrieverProcess(index_dir) as rp:
    client = RetrieverClient(rp.url)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse

from searchr1.redis_server import free_port


class RetrieverProcess:
    """`searchr1 retriever serve` on free loopback ports; `start()` waits for /ready."""

    def __init__(
        self,
        index_dir: Path | None = None,
        *,
        config: dict[str, Any] | None = None,
        grpc: bool = True,
        web: bool = False,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 180.0,
    ) -> None:
        self.index_dir = index_dir
        self.port = free_port()
        self.grpc_port = free_port() if grpc else None
        self.config = {"retriever": config or {}, "logging": {"level": "WARNING"}}
        self.web = web
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="retriever-")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cfg = Path(self._tmp.name) / "config.yaml"
        cfg.write_text(json.dumps(self.config))  # JSON is YAML
        cmd = [sys.executable, "-m", "searchr1.cli", "retriever", "serve", "--config", str(cfg)]
        cmd += ["--port", str(self.port), "--grpc-port", str(self.grpc_port or -1)]
        if self.index_dir is not None:
            cmd += ["--index", str(self.index_dir)]
        if self.web:
            cmd.append("--web")
        return cmd

    def start(self) -> RetrieverProcess:
        self.proc = subprocess.Popen(self.command(), env=self.env)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"retriever exited with status {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"retriever not ready after {self.ready_timeout_s}s")

    def stop(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._tmp.cleanup()
        return None if self.proc is None else self.proc.returncode

    def __enter__(self) -> RetrieverProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeSerper:
    """A local HTTP server speaking serper.dev's search schema (serper cannot be reached here).

    `fail_with` holds status codes answered (in order) before normal answers resume; every
    request's arrival time is recorded in `arrivals`.
    """

    def __init__(self, api_key: str = "test-key") -> None:
        self.api_key = api_key
        self.port = free_port()
        self.fail_with: list[int] = []
        self.arrivals: list[float] = []
        self.bodies: list[dict[str, Any]] = []
        self._server: Any = None
        self._thread: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/search"

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/search")
        async def search(request: Request, x_api_key: str | None = Header(default=None)):
            self.arrivals.append(time.monotonic())
            if x_api_key != self.api_key:
                return JSONResponse({"message": "Unauthorized."}, status_code=403)
            body = await request.json()
            self.bodies.append(body)
            if self.fail_with:
                return JSONResponse({"message": "fail"}, status_code=self.fail_with.pop(0))
            q, num = body["q"], int(body.get("num", 10))
            organic = [
                {
                    "title": f"{q} title {i}",
                    "link": f"https://example.org/{i}?q={q.replace(' ', '+')}",
                    "snippet": f"snippet {i} about {q}",
                    "position": i,
                }
                for i in range(1, num + 1)
            ]
            return {"searchParameters": body, "organic": organic}

        return app

    def start(self) -> FakeSerper:
        import threading

        import uvicorn

        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("fake serper did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)

    def __enter__(self) -> FakeSerper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
