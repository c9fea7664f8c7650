"""The orchestrator's HTTP layer: /health, /ready, /metrics, /status over the rollout loop,
and the run inspector at /ui when `ui` is on. No serving loop here: `orchestrator.wiring.serve`
runs this app beside the loop and fills its `LoopState`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from engine_client.client import InferenceClient
from engine_client.pool import EnginePool
from inspector.server import create_app as create_inspector
from orchestrator.loop import Orchestrator
from retriever.client import RetrieverClient
from searchr1.bus import TrajectoryBus
from searchr1.service import create_service_app


@dataclass
class LoopState:
    """The rollout loop as /ready and /status see it."""

    orchestrator: Orchestrator | None = None  # None while it is being built
    done: bool = False
    error: str | None = None


def create_app(
    engine: InferenceClient | EnginePool,
    retriever: RetrieverClient,
    bus: TrajectoryBus,
    state: LoopState,
    *,
    ui_run_dir: str | None = None,
    uses_retriever: bool = True,
) -> FastAPI:
    """`uses_retriever`: whether /ready waits for the retriever (a task without search does
    not)."""

    async def engine_ready() -> str:
        info = await engine.get_model_info()
        return f"weight_version {info['weight_version']}"

    async def retriever_ready() -> str:
        if not await retriever.ready():
            raise RuntimeError("retriever /ready failed")
        return "ok"

    async def redis_ready() -> str:
        return str(await bus.ping())

    async def loop_ready() -> str:
        if state.error:
            raise RuntimeError(state.error)
        return "running" if state.orchestrator else "starting"

    checks = {"engine": engine_ready, "retriever": retriever_ready}
    if not uses_retriever:
        del checks["retriever"]
    app = create_service_app(
        "orchestrator", ready_checks={**checks, "redis": redis_ready, "loop": loop_ready}
    )

    @app.get("/status")
    async def status() -> dict[str, Any]:
        orch = state.orchestrator
        return {
            "step": orch.step if orch else None,
            "base_version": orch.base_version if orch else None,
            "engine_version": orch.current_version if orch else None,
            "running": bool(orch and orch.running),
            "done": state.done,
            "error": state.error,
            "last_step": orch.last_summary if orch else {},
            "last_eval": orch.last_eval if orch else {},
        }

    if ui_run_dir is not None:
        app.mount("/ui", create_inspector(Path(ui_run_dir)))
    return app
