"""The trainer process: the training loop plus a small HTTP server (rank 0 only).

`/health`, `/ready` (model loaded and the bus reachable), `/metrics`, and `GET /status` (step,
weight version, the last step's metrics). The loop runs as a background task; each step's
compute runs in a worker thread so the HTTP endpoints stay responsive. SIGTERM (or the end of
`run.max_steps`) stops the loop after the current step, which is then checkpointed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from searchr1.bus import TrajectoryBus
from searchr1.lease import LeaseHeld, RedisLease
from searchr1.sections import BusConfig, HttpConfig
from searchr1.service import create_service_app, uvicorn_server
from trainer.loop import TrainingLoop

log = logging.getLogger(__name__)


def create_app(loop: TrainingLoop, bus: TrajectoryBus, *, resume: bool) -> FastAPI:
    async def model_ready() -> str | None:
        return f"step {loop.status.step}"

    async def bus_ready() -> str | None:
        return await bus.ping()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One trainer per run: a second one would train the same entries, or ack what it did
        # not checkpoint. A restarted trainer waits for its dead predecessor's lease to expire.
        lease = RedisLease(bus.redis, f"{bus.stream}:trainer-lease", ttl_s=loop.cfg.lease_ttl_s)
        try:
            await lease.acquire(wait_s=loop.cfg.lease_ttl_s * 1.5)
        except LeaseHeld as e:
            log.error("another trainer is training this run", extra={"error": str(e)})
            app.state.exit_code = 1
            raise
        # Acks are fenced by the lease token: Redis refuses them once the lease is another's.
        bus.fence_with(lease.key, lease.token)
        keeper = asyncio.create_task(lease.keep(), name="trainer-lease")
        keeper.add_done_callback(_on_lease_lost(app))
        if resume:
            try:
                await loop.resume()
            except Exception as e:
                # Never a clean exit: compose's on-failure and a Kubernetes Job read exit 0 as
                # "finished". uvicorn then stops with its start-up failure code (3).
                log.error("resume failed", extra={"error": repr(e)}, exc_info=e)
                app.state.exit_code = 1
                raise
        # The weight group is joined lazily at the first push: engines may start after us.
        app.state.task = asyncio.create_task(loop.run(), name="training-loop")
        app.state.task.add_done_callback(_on_loop_done(app))
        try:
            yield
        finally:
            loop.stop_event.set()
            await asyncio.gather(app.state.task, return_exceptions=True)
            await loop.pusher.close()
            keeper.cancel()
            with contextlib.suppress(Exception):
                await lease.release()

    app = create_service_app(
        "trainer", ready_checks={"model": model_ready, "bus": bus_ready}, lifespan=lifespan
    )

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


def _ignore_signals_after_shutdown() -> None:
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown; with the default
    # handler that kills the process (status -15) although everything was saved.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)


def _on_lease_lost(app: FastAPI):  # type: ignore[no-untyped-def]
    def lost(task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        # Another trainer may own the run now: stop without a checkpoint or an ack.
        log.error("trainer lease lost; stopping", extra={"error": repr(task.exception())})
        app.state.exit_code = 1
        loop_task = getattr(app.state, "task", None)
        if loop_task is not None:
            loop_task.cancel()
        server = getattr(app.state, "server", None)
        if server is not None:
            server.should_exit = True

    return lost


def _on_loop_done(app: FastAPI):  # type: ignore[no-untyped-def]
    def done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("training loop failed", exc_info=task.exception())
            app.state.exit_code = 1
        server = getattr(app.state, "server", None)
        if server is not None:  # the loop is the process's purpose: stop serving with it
            server.should_exit = True

    return done


async def serve_trainer(
    loop: TrainingLoop, bus: TrajectoryBus, http: HttpConfig, *, resume: bool
) -> int:
    app = create_app(loop, bus, resume=resume)
    app.state.exit_code = 0
    server = uvicorn_server(app, http)
    app.state.server = server
    _ignore_signals_after_shutdown()
    log.info("listening", extra={"host": http.host, "port": http.port})
    try:
        await server.serve()
    finally:
        await bus.close()
    return int(app.state.exit_code)


async def run_follower(loop: TrainingLoop, *, resume: bool) -> int:
    """Ranks > 0: no bus, no HTTP; follow rank 0's broadcasts."""
    if resume:
        await loop.resume()
    await loop.run()
    return 0


def make_bus(url: str, cfg: BusConfig) -> TrajectoryBus:
    # One trainer per stream (its lease), so one stable consumer name: a restarted trainer (new
    # pid, new pod) reads back the entries its dead predecessor held at once, instead of after
    # bus.reclaim_idle_s (found by bench/chaos.py: every trainer crash stalled the run 60 s).
    if cfg.consumer is None:
        cfg = cfg.model_copy(update={"consumer": f"{cfg.group}-trainer"})
    return TrajectoryBus.from_url(url, cfg)
