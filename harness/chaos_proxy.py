"""An HTTP reverse proxy that can fail on purpose: the network between two services, for chaos.

`refuse_next(path)` answers the next request to `path` with 503 (an engine refusing one weight
push); `outage(seconds)` stops listening for that long (connections refused: a service down).
Everything else is forwarded unchanged. Runs uvicorn on a thread of the calling process.
"""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from searchr1.redis_server import free_port

# Hop-by-hop headers and those httpx recomputes must not be copied across.
_DROP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


class FaultyProxy:
    def __init__(self, upstream: str, port: int | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = port or free_port()
        self._refuse: dict[str, int] = {}
        self.refused_at: list[float] = []  # when each refusal was answered (monotonic)
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def refuse_next(self, path: str) -> None:
        with self._lock:
            self._refuse[path] = self._refuse.get(path, 0) + 1

    def _app(self) -> Starlette:
        client = httpx.AsyncClient(base_url=self.upstream, timeout=None)

        async def forward(request: Request) -> Response:
            path = request.url.path
            with self._lock:
                refuse = self._refuse.get(path, 0) > 0
                if refuse:
                    self._refuse[path] -= 1
                    self.refused_at.append(time.monotonic())
            if refuse:
                return Response("refused by the chaos proxy", status_code=503)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
            try:
                resp = await client.request(
                    request.method,
                    path,
                    params=request.query_params,
                    content=await request.body(),
                    headers=headers,
                )
            except httpx.HTTPError as e:  # the upstream is down: say so, as a gateway would
                return Response(f"upstream unreachable: {e!r}", status_code=502)
            out = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP}
            return Response(resp.content, status_code=resp.status_code, headers=out)

        methods = ["GET", "POST", "PUT", "DELETE"]
        return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])

    def start(self, timeout_s: float = 10.0) -> FaultyProxy:
        config = uvicorn.Config(
            self._app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True, name="chaos-proxy")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"chaos proxy on port {self.port} did not start")
            time.sleep(0.05)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._server = self._thread = None

    def outage(self, seconds: float) -> None:
        """Refuse connections for `seconds` (blocks), then listen again on the same port."""
        self.stop()
        time.sleep(seconds)
        self.start()
