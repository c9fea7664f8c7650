"""Run a real retriever server process, and a fake serper.dev, for tests and benchmarks.

with RetrieverProcess(index_dir) as rp:
    client = RetrieverClient(rp.url)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse

from searchr1.redis_server import free_port
from searchr1.supervisor import ServiceProcess, ServiceSpec


class RetrieverProcess(ServiceProcess):
    """`searchr1 retriever serve` on free loopback ports (a `ServiceProcess`: `start()` waits
    for /ready; a failure carries the log's last lines)."""

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
        self.port = free_port()
        self.grpc_port = free_port() if grpc else None
        super().__init__(ServiceSpec("retriever", [], env=dict(env or {})))
        cfg = self.child.log_path.parent / "config.yaml"
        cfg.write_text(json.dumps({"retriever": config or {}, "logging": {"level": "WARNING"}}))
        cmd = [
            sys.executable,
            "-m",
            "stack.cli",
            "retriever",
            "serve",
            "--config",
            str(cfg),
        ]
        cmd += ["--port", str(self.port), "--grpc-port", str(self.grpc_port or -1)]
        if index_dir is not None:
            cmd += ["--index", str(index_dir)]
        if web:
            cmd.append("--web")
        self.child.spec.command = cmd
        self.child.spec.ready_url = f"{self.url}/ready"
        self.child.spec.ready_timeout_s = ready_timeout_s

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


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
