"""The trainer's wiring: `searchr1 trainer run` -> `run_trainer` -> `TrainingLoop.run`.

`run_trainer` joins the ranks, builds the configured backend (`trainer.backends.registry`),
the weight pusher, the bus (rank 0 only) and the training loop, then runs the loop. Rank 0
runs it beside its HTTP endpoints (`trainer.server`) and under the run's lease: one trainer per
bus stream, a restarted one waits for its dead predecessor's lease to expire, and one that
loses its lease stops at once. SIGTERM (or the end of `run.max_steps`) stops the loop after the
current step, which is then checkpointed. Ranks > 0 have no bus and no HTTP: they follow rank
0's broadcasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import torch
import uvicorn

from searchr1.bus import TrajectoryBus
from searchr1.dotted import load_object
from searchr1.lease import LeaseHeld, RedisLease
from searchr1.sections import BusConfig
from searchr1.service import exit_cleanly_after_shutdown, uvicorn_server
from searchr1.settings import ConfigError
from searchr1.supervisor import EXIT_NO_RESTART
from searchr1.weightsync.registry import EngineRegistry, registry_key
from trainer.backend import TrainerBackend
from trainer.backends.registry import BACKENDS
from trainer.checkpoint import CheckpointManager
from trainer.config import CheckpointConfig, TrainerConfig, TrainerSettings
from trainer.dist import DistInfo, init_distributed
from trainer.loop import DataEnded, TrainingLoop
from trainer.server import create_app
from trainer.weights import WeightPusher

log = logging.getLogger(__name__)

BackendLoader = Callable[[TrainerConfig, DistInfo], TrainerBackend]


def backend_loader(name: str) -> BackendLoader:
    """The loader `trainer.backends.registry` names for `name` (or `name` itself, a dotted path
    `pkg.module:loader` to a user's backend), imported now: only the chosen backend's
    dependencies load (megatron-core is optional). ConfigError: a dotted path that does not
    import, or whose object cannot be called as `loader(TrainerConfig, DistInfo)`."""
    path = BACKENDS.get(name, name)
    try:
        loader: BackendLoader = load_object(path)
        inspect.signature(loader).bind(None, None)
    except (ImportError, AttributeError, ValueError, TypeError) as e:
        if name in BACKENDS:
            raise  # a built-in backend's own failure (megatron-core missing): not the config's
        raise ConfigError(
            f"trainer.backend {name!r}: not a loader(TrainerConfig, DistInfo): "
            f"{type(e).__name__}: {e}"
        ) from None
    return loader


def load_backend(section: TrainerConfig, info: DistInfo) -> TrainerBackend:
    """The configured backend (`trainer.backend`) over the joined ranks."""
    return backend_loader(section.backend)(section, info)


def trainer_lease_key(stream: str) -> str:
    """The run's trainer lease: one per bus stream (the chaos bench polls its holder)."""
    return f"{stream}:trainer-lease"


def make_bus(url: str, cfg: BusConfig) -> TrajectoryBus:
    # One trainer per stream (its lease), so one stable consumer name: a restarted trainer (new
    # pid, new pod) reads back the entries its dead predecessor held at once, instead of after
    # bus.reclaim_idle_s (found by bench/chaos.py: every trainer crash stalled the run 60 s).
    if cfg.consumer is None:
        cfg = cfg.model_copy(update={"consumer": f"{cfg.group}-trainer"})
    return TrajectoryBus.from_url(url, cfg)


def build_loop(cfg: TrainerSettings) -> TrainingLoop:
    """Join the ranks and build what the loop uses (the bus on rank 0 only). ConfigError: a
    weight push the config cannot make."""
    section = cfg.trainer
    info = init_distributed(section.model.device)
    torch.manual_seed(section.model.seed)
    token = cfg.admin_token.get_secret_value() if cfg.admin_token else None
    registry = None
    if cfg.engines.discover and info.rank == 0:
        if not cfg.redis.url:
            raise ConfigError("engines.discover needs redis.url (the engine registry)")
        registry = EngineRegistry.from_url(cfg.redis.url, registry_key(cfg.bus.stream))
    try:
        pusher = WeightPusher(section.weight_push, token=token, registry=registry, run=cfg.run.id)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    backend = load_backend(section, info)
    bus = None
    if info.rank == 0:
        assert cfg.redis.url, "checked by the CLI"
        bus = make_bus(cfg.redis.url, cfg.bus)
    return TrainingLoop(section, backend, info, run=cfg.run, bus=bus, pusher=pusher)


async def run_trainer(cfg: TrainerSettings, *, resume: bool) -> int:
    """Train until `run.max_steps`, SIGTERM or a failure: the process's exit status."""
    loop = build_loop(cfg)
    bus = loop.bus
    if bus is None:  # ranks > 0
        if resume:
            await loop.resume()
        try:
            await loop.run()
        except DataEnded:  # rank 0 tells why
            return EXIT_NO_RESTART
        return 0
    http = cfg.trainer.http
    rank0 = _Rank0(uvicorn_server(create_app(loop, bus), http))
    exit_cleanly_after_shutdown()
    log.info("listening", extra={"host": http.host, "port": http.port})
    try:
        async with _run_lease(loop, bus, rank0.lease_lost) as lease:
            if resume and not await _resumed(loop):
                return 1
            # The weight group is joined lazily at the first push: engines may start after us.
            training = rank0.training = asyncio.create_task(
                loop.run(holds_lease=lease.check), name="training-loop"
            )
            training.add_done_callback(rank0.loop_done)
            try:
                await rank0.server.serve()
            finally:  # SIGTERM, or the loop ended: the current step finishes and is saved
                loop.stop_event.set()
                await asyncio.gather(training, return_exceptions=True)
                await loop.pusher.close()
        return rank0.exit_code
    except LeaseHeld as e:
        log.error("another trainer is training this run", extra={"error": str(e)})
        return 1
    finally:
        await bus.close()


def export_checkpoint(section: TrainerConfig, path: Path, out: Path) -> Path | None:
    """Write checkpoint `path`'s weights into `out` as a Hugging Face directory, in this one
    CPU process: a Megatron checkpoint names no layout, any layout reads it back."""
    section.loss.kl_coef = 0.0  # no reference model needed to export
    section.megatron.tp = section.megatron.pp = 1
    section.model.device = "cpu"
    backend = load_backend(section, init_distributed("cpu"))
    CheckpointManager(CheckpointConfig(dir=str(path.parent))).load(backend, path, weights_only=True)
    return backend.export_hf(out)


# -- rank 0's pieces -----------------------------------------------------------------------


class _Rank0:
    """What the training task, the lease keeper and the HTTP server share to stop each other."""

    def __init__(self, server: uvicorn.Server) -> None:
        self.server = server
        self.training: asyncio.Task[None] | None = None
        self.exit_code = 0

    def loop_done(self, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if isinstance(error, DataEnded):  # what it trained is saved; a restart cannot help
            log.error("training stopped: the data ran out", extra={"error": str(error)})
            self.exit_code = EXIT_NO_RESTART
        elif error is not None:
            log.error("training loop failed", exc_info=error)
            self.exit_code = 1
        self.server.should_exit = True  # the loop is the process's purpose: stop serving with it

    def lease_lost(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        # Another trainer may own the run now: stop without a checkpoint or an ack.
        log.error("trainer lease lost; stopping", extra={"error": repr(task.exception())})
        self.exit_code = 1
        if self.training is not None:
            self.training.cancel()
        self.server.should_exit = True


@contextlib.asynccontextmanager
async def _run_lease(
    loop: TrainingLoop, bus: TrajectoryBus, on_lost: Callable[[asyncio.Task[None]], None]
) -> AsyncIterator[RedisLease]:
    """Hold the run's trainer lease while the body runs (LeaseHeld: another trainer has it).

    One trainer per run: a second one would train the same entries, or ack what it did not
    checkpoint. A restarted trainer waits for its dead predecessor's lease to expire."""
    ttl_s = loop.cfg.lease_ttl_s
    # Started while Redis is frozen or restarting, it waits for Redis as every other call does.
    lease = RedisLease(
        bus.redis,
        trainer_lease_key(bus.stream),
        ttl_s=ttl_s,
        redis_wait_s=bus.config.reconnect_timeout_s,
    )
    wait_s = loop.cfg.lease_wait_s
    await lease.acquire(wait_s=ttl_s * 1.5 if wait_s is None else wait_s)
    # Acks are fenced by the lease token: Redis refuses them once the lease is another's.
    bus.fence_with(lease.key, lease.token)
    keeper = asyncio.create_task(lease.keep(), name="trainer-lease")
    keeper.add_done_callback(on_lost)
    try:
        yield lease
    finally:
        keeper.cancel()
        with contextlib.suppress(Exception):
            await lease.release()


async def _resumed(loop: TrainingLoop) -> bool:
    try:
        await loop.resume()
    except Exception as e:
        # Never a clean exit: compose's on-failure and a Kubernetes Job read exit 0 as
        # "finished".
        log.error("resume failed", extra={"error": repr(e)}, exc_info=e)
        return False
    return True
