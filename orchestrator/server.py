"""The orchestrator's HTTP layer: /health, /ready, /metrics, /status over the rollout loop,
and the run inspector at /ui when `ui` is on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from orchestrator.config import OrchestratorConfig
from orchestrator.loop import Orchestrator
from orchestrator.markers import RunIdInUse
from orchestrator.wiring import Clients, build_orchestrator, make_clients
from searchr1.sections import BusConfig, RunConfig
from searchr1.service import create_service_app, uvicorn_server

log = logging.getLogger(__name__)


def create_app(
    clients: Clients, state: dict[str, Any], *, ui_run_dir: str | None = None
) -> FastAPI:
    async def engine_ready() -> str:
        info = await clients.engine.get_model_info()
        return f"weight_version {info['weight_version']}"

    async def retriever_ready() -> str:
        if not await clients.retriever.ready():
            raise RuntimeError("retriever /ready failed")
        return "ok"

    async def redis_ready() -> str:
        return str(await clients.bus.ping())

    async def loop_ready() -> str:
        if state.get("error"):
            raise RuntimeError(state["error"])
        return "running" if state.get("orchestrator") else "starting"

    app = create_service_app(
        "orchestrator",
        ready_checks={
            "engine": engine_ready,
            "retriever": retriever_ready,
            "redis": redis_ready,
            "loop": loop_ready,
        },
    )

    @app.get("/status")
    async def status() -> dict[str, Any]:
        orch: Orchestrator | None = state.get("orchestrator")
        return {
            "step": orch.step if orch else None,
            "base_version": orch.base_version if orch else None,
            "engine_version": orch.current_version if orch else None,
            "running": bool(orch and orch.running),
            "done": state.get("done", False),
            "error": state.get("error"),
            "last_step": orch.last_summary if orch else {},
            "last_eval": orch.last_eval if orch else {},
        }

    if ui_run_dir is not None:
        from inspector.server import create_app as create_inspector

        app.mount("/ui", create_inspector(Path(ui_run_dir)))
    return app


async def serve(
    cfg: OrchestratorConfig,
    run: RunConfig,
    redis_url: str,
    bus_cfg: BusConfig,
    *,
    fresh: bool = False,
) -> int:
    """Run the loop with its HTTP endpoints; exit status 0 when all steps are done."""
    clients = make_clients(cfg, redis_url, bus_cfg)
    state: dict[str, Any] = {}
    ui = cfg.rollout_log.run_dir if cfg.ui else None
    server = uvicorn_server(create_app(clients, state, ui_run_dir=ui), cfg.http)

    async def loop() -> None:
        try:
            orch = await build_orchestrator(cfg, run, clients)
            state["orchestrator"] = orch
            await orch.run(fresh=fresh)
            state["done"] = True
        except RunIdInUse as e:  # a usage error: the message says what to do
            state["error"] = str(e)
            log.error(str(e))
        except Exception as e:
            state["error"] = f"{type(e).__name__}: {e}"
            log.exception("rollout loop failed")
        finally:
            server.should_exit = True

    try:
        task = asyncio.create_task(loop())
        await server.serve()
        if not task.done():  # SIGTERM: stop rolling out; unpublished groups are redone later
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        await clients.aclose()
    return 1 if state.get("error") else 0
