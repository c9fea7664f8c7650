"""Retriever wiring: the engine, the HTTP app and the gRPC server, served together.

`searchr1 retriever serve` calls `serve`. The port opens at once and the engine loads in the
background (index loading takes seconds to minutes): /health answers at once, /ready and
/retrieve answer 503 until it has loaded. A failed load stops the server through the graceful
path (as SIGTERM does) and `serve` returns the error (the CLI exits 1).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI
from pydantic import SecretStr

from retriever.config import RetrieverConfig
from retriever.engine import RetrieverEngine
from retriever.grpc_server import start_grpc_server
from retriever.server import Serving, create_app
from searchr1.service import serve_http

log = logging.getLogger(__name__)


def lifespan(
    cfg: RetrieverConfig,
    serving: Serving,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: load the engine in the background (unless `serving` has one), run the
    gRPC server beside the app; on shutdown drain gRPC, then close the engine."""

    async def load() -> None:
        try:
            serving.engine = await RetrieverEngine.load(cfg)
            log.info("retriever ready", extra={"backend": serving.engine.backend.name})
        except Exception as e:
            serving.error = e
            log.exception("loading the retriever backend failed")
            if on_load_error is not None:
                on_load_error(e)

    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        loader = None if serving.engine is not None else asyncio.create_task(load())
        grpc_server = None
        if cfg.grpc_port is not None:
            grpc_server, serving.grpc_port = await start_grpc_server(
                lambda: serving.engine, cfg.http.host, cfg.grpc_port
            )
        app.state.grpc_port = serving.grpc_port
        try:
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=cfg.http.graceful_shutdown_s)
            if loader is not None and not loader.done():
                loader.cancel()
            if serving.engine is not None:
                await serving.engine.aclose()

    return run


def build_app(
    cfg: RetrieverConfig,
    *,
    admin_token: SecretStr | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The HTTP app whose lifespan loads the engine and runs the gRPC server."""
    serving = Serving()
    return create_app(
        cfg, serving, admin_token=admin_token, lifespan=lifespan(cfg, serving, on_load_error)
    )


async def serve(cfg: RetrieverConfig, admin_token: SecretStr | None = None) -> BaseException | None:
    """Serve HTTP and gRPC until SIGTERM/SIGINT; the error that stopped the load, if one did."""
    failed: list[BaseException] = []

    def on_load_error(e: BaseException) -> None:
        # Stop through the normal graceful path (as on SIGTERM); the caller exits 1.
        failed.append(e)
        os.kill(os.getpid(), signal.SIGTERM)

    await serve_http(build_app(cfg, admin_token=admin_token, on_load_error=on_load_error), cfg.http)
    return failed[0] if failed else None
