"""The trainer's HTTP layer (rank 0 only): `/health`, `/ready` (model loaded and the bus
reachable), `/metrics`, and `GET /status` (step, weight version, the last step's metrics).

Endpoints only: `trainer.wiring.run_trainer` serves this app beside the training loop. Each
step's compute runs in a worker thread, so the endpoints stay responsive while it trains.
"""

from __future__ import annotations

from fastapi import FastAPI

from searchr1.bus import TrajectoryBus
from searchr1.service import create_service_app
from trainer.loop import TrainingLoop


def create_app(loop: TrainingLoop, bus: TrajectoryBus) -> FastAPI:
    async def model_ready() -> str | None:
        return f"step {loop.status.step}"

    async def bus_ready() -> str | None:
        return await bus.ping()

    app = create_service_app("trainer", ready_checks={"model": model_ready, "bus": bus_ready})

    @app.get("/status")
    async def status() -> dict[str, object]:
        s = loop.status
        return {
            "step": s.step,
            "weight_version": s.weight_version,
            "running": s.running,
            "metrics": s.last_metrics,
        }

    return app
