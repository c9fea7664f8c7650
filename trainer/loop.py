"""The training loop: bus -> groups -> step -> weight push -> checkpoint -> step line -> ack.

Exactly-once training across crashes: the receipts of every trajectory trained since the last
checkpoint are kept; they are stored in the next checkpoint and acknowledged on the bus only
after it is durable. A crash before that leaves the entries pending on the bus and the model at
the previous checkpoint, so they are trained again exactly once; a crash after the checkpoint
but before the ack is repaired on resume by re-acknowledging the checkpoint's receipts before
consuming anything.

A step that raises crashes the trainer, every time (the restart resumes from the checkpoint);
on the batch's `bus.max_deliveries`-th delivery its groups are dead-lettered first, so the
crash-restart loop ends (docs/bus.md, "Poison entries"). Groups that cannot complete are
dead-lettered after `batch.incomplete_group_timeout_s`.

With several ranks (torchrun), rank 0 reads the bus and broadcasts each step's trajectories;
all ranks run the step, checkpoint and push collectively.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from protos.trajectory import Trajectory, decode, encode
from searchr1.bus import Delivery, Receipt, TrajectoryBus
from searchr1.rundir import METRICS_STEP, METRICS_TIME, METRICS_TRAINER, METRICS_TRAJECTORY_IDS
from searchr1.sections import RunConfig
from trainer.backend import TrainerBackend
from trainer.checkpoint import CheckpointDiskFull, CheckpointManager, TrainerState
from trainer.config import TrainerConfig
from trainer.dist import DistInfo, broadcast_object
from trainer.metrics import (
    CHECKPOINT_SECONDS,
    ERRORS,
    JsonlLog,
    OptionalSinks,
    record_step,
    staleness_metrics,
)
from trainer.step import train_on
from trainer.weights import WeightPusher

log = logging.getLogger(__name__)


class _Resync(str):
    """Rank 0's message to every rank: push the current weights again before the next step."""


RESYNC = _Resync("resync")


class DataEnded(RuntimeError):
    """The producer ended the bus (its data ran out) before the trainer's last step."""


class WeightPushFailed(RuntimeError):
    """The engines could not be given the current weights within the retry deadline."""


class GroupBuffer:
    """Holds deliveries until their prompt group is complete (`group_size` members)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._groups: dict[str, list[Delivery]] = {}
        self._complete: list[str] = []
        self._clock = clock
        self._since: dict[str, float] = {}  # group id -> when its first member arrived

    def add(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            gid = d.trajectory.group_id or d.trajectory.trajectory_id
            members = self._groups.setdefault(gid, [])
            self._since.setdefault(gid, self._clock())
            members.append(d)
            # group_size 0 (unset) means a group of one.
            if len(members) == max(d.trajectory.group_size, 1) and gid not in self._complete:
                self._complete.append(gid)

    @property
    def complete_groups(self) -> int:
        return len(self._complete)

    def held(self) -> int:
        return sum(len(v) for v in self._groups.values())

    def take(self, n_groups: int) -> list[Delivery]:
        out: list[Delivery] = []
        for gid in self._complete[:n_groups]:
            out += self._groups.pop(gid)
            del self._since[gid]
        self._complete = self._complete[n_groups:]
        return out

    def expire(self, timeout_s: float) -> list[tuple[str, list[Delivery]]]:
        """Remove and return the groups still incomplete `timeout_s` after their first member
        arrived: the orchestrator publishes a group whole, so their missing members are gone
        (dead-lettered, or never published) and they would hold backlog forever."""
        now = self._clock()
        old = [
            gid
            for gid, since in self._since.items()
            if now - since > timeout_s and gid not in self._complete
        ]
        for gid in old:
            del self._since[gid]
        return [(gid, self._groups.pop(gid)) for gid in old]


@dataclass
class LoopStatus:
    step: int = 0
    weight_version: int = 0
    running: bool = False
    last_metrics: dict[str, float] = field(default_factory=dict)


class TrainingLoop:
    def __init__(
        self,
        cfg: TrainerConfig,
        backend: TrainerBackend,
        info: DistInfo,
        *,
        run: RunConfig,
        bus: TrajectoryBus | None,
        pusher: WeightPusher | None = None,
    ) -> None:
        if info.rank == 0 and bus is None:
            raise ValueError("rank 0 needs the trajectory bus")
        self.cfg = cfg
        self.run_cfg = run
        self.backend = backend
        self.info = info
        self.bus = bus
        self.pusher = pusher or WeightPusher(cfg.weight_push)
        self.ckpt = CheckpointManager(cfg.checkpoint) if cfg.checkpoint.dir else None
        self.jsonl = JsonlLog(cfg.metrics_jsonl if info.rank == 0 else None)
        main = info.rank == 0
        self.sinks = OptionalSinks(
            cfg.tensorboard_dir if main else None, cfg.wandb_project if main else None
        )
        self.status = LoopStatus()
        self.stop_event = asyncio.Event()
        self._buffer = GroupBuffer()
        self._batch: list[Delivery] = []  # rank 0: the deliveries of the step being trained
        self._unacked: list[Receipt] = []  # trained since the last durable checkpoint
        self._checkpointed_step = 0
        self._disk_full = False  # the last checkpoint met a full disk (logged once per spell)
        self._resumed = False
        self._holds_lease: Callable[[], None] = lambda: None  # set by run()
        self._last_resync_check = time.monotonic()
        self._ended: str | None = None  # rank 0: the producer's reason for publishing no more

    # -- start-up -------------------------------------------------------------------------

    async def resume(self) -> bool:
        """Load the latest checkpoint if any (collective); re-ack its receipts."""
        if self.ckpt is None:
            return False
        exists = broadcast_object(self.ckpt.latest() is not None, self.info)
        if not exists:
            return False
        state = await asyncio.to_thread(self.ckpt.load, self.backend)
        meta = broadcast_object((state.step, state.weight_version) if state else None, self.info)
        self.status.step, self.status.weight_version = meta
        self._checkpointed_step = self.status.step
        self._resumed = True
        if state is not None and self.bus is not None and state.receipts:
            # The crash may have hit between the checkpoint and its ack.
            n = await self.bus.ack(state.receipts)
            log.info("re-acknowledged checkpoint receipts", extra={"count": n})
        log.info("resumed", extra={"step": self.status.step})
        return True

    # -- data -----------------------------------------------------------------------------

    async def _next_batch(self) -> list[Delivery] | _Resync | None:
        """Rank 0: deliveries of `run.groups_per_step` complete groups, None when stopping, or
        RESYNC when an engine must get the current weights again first."""
        assert self.bus is not None
        want = self.run_cfg.groups_per_step
        await self._expire_incomplete_groups()
        while self._buffer.complete_groups < want:
            if self.stop_event.is_set():
                return None
            if await self._engines_behind():
                return RESYNC
            n = max(want - self._buffer.complete_groups, 1) * self.run_cfg.group_size
            got = await self.bus.consume(min(n, 512), block=self.cfg.batch.consume_block_s)
            if not got and (reason := await self.bus.ended()) is not None:
                self._ended = reason  # nothing more will come: stop instead of waiting on
                return None
            self._buffer.add(got)
            await self._expire_incomplete_groups()
        self._batch = self._buffer.take(want)
        return self._batch

    async def _engines_behind(self) -> bool:
        """Rank 0, every `resync_check_s` while waiting for data: does an engine serve an older
        version than the trainer's? One that restarted serves its initial weights (version 0):
        sync rollouts would wait for the trainer's version forever while the trainer waits for
        their data, so it gets the current weights again (all ranks push: it is collective)."""
        every = self.cfg.weight_push.resync_check_s
        if not self.pusher.enabled or self.status.step == 0:
            return False
        if time.monotonic() - self._last_resync_check < every:
            return False
        self._last_resync_check = time.monotonic()
        behind = await self.pusher.engines_behind(self.status.weight_version)
        if behind:
            log.warning(
                "engines behind the trainer's version; pushing again",
                extra={"engines": behind, "version": self.status.weight_version},
            )
        return bool(behind)

    async def _expire_incomplete_groups(self) -> None:
        """Dead-letter groups that can no longer complete: held, they would hold their entries
        (and the backlog bound) forever."""
        assert self.bus is not None
        timeout = self.cfg.batch.incomplete_group_timeout_s
        for gid, members in self._buffer.expire(timeout):
            size = max(members[0].trajectory.group_size, 1)
            error = (
                f"group {gid}: {len(members)} of {size} members after {timeout:g}s "
                "(trainer.batch.incomplete_group_timeout_s)"
            )
            await self.bus.dead_letter(members, "incomplete_group", error)

    async def _step_input(self) -> tuple[list[Trajectory] | None, list[Receipt]]:
        """The next step's trajectories on every rank (rank 0 reads the bus and broadcasts), or
        None when stopping. Re-syncs engines that fell behind on the way."""
        while True:
            deliveries: list[Delivery] | _Resync | None = None
            if self.info.rank == 0:
                deliveries = await self._next_batch()
            if isinstance(deliveries, list) and not self.info.distributed:
                # One process: the bus decoded them already (no wire round trip, ~0.5 s a
                # step at 2,048 samples).
                return [d.trajectory for d in deliveries], [d.receipt for d in deliveries]
            payload: list[bytes] | _Resync | None
            if isinstance(deliveries, list):
                payload = [encode(d.trajectory) for d in deliveries]
            else:
                payload = deliveries
            payload = await asyncio.to_thread(broadcast_object, payload, self.info)
            if payload == RESYNC:
                await self._push(self.status.step)
                continue
            if payload is None:
                return None, []
            assert isinstance(payload, list)
            receipts = [d.receipt for d in deliveries] if isinstance(deliveries, list) else []
            return [decode(b) for b in payload], receipts

    # -- the loop -------------------------------------------------------------------------

    def _done(self) -> bool:
        last = self.run_cfg.max_steps
        return last is not None and self.status.step >= last

    async def run(self, *, holds_lease: Callable[[], None] | None = None) -> None:
        """Train until `run.max_steps`, a stop or the end of the data. `holds_lease` raises
        (LeaseLost) once this trainer may no longer hold the run's lease: called before what
        Redis cannot fence, each weight push and each checkpoint."""
        self._holds_lease = holds_lease or (lambda: None)
        self.status.running = True
        try:
            if self.pusher.enabled and (self._resumed or self.pusher.releases_engines):
                # Engines may hold weights of steps lost in the crash: realign them. Colocated,
                # a crashed predecessor may also have left them released: the push resumes them.
                await self._push(self.status.step)
            while not self._done():
                t0 = time.perf_counter()
                trajs, receipts = await self._step_input()
                if trajs is None:
                    break
                wait_s = time.perf_counter() - t0
                release_s = await self._release_engines()
                self._move_between_steps("reload")
                metrics = await self._train(trajs)
                if release_s is not None:
                    metrics["time/engine_release_s"] = release_s
                metrics.update(
                    staleness_metrics([t.weight_version for t in trajs], self.status.step)
                )
                step = self.status.step = self.status.step + 1
                self._unacked += receipts
                metrics["time/wait_data_s"] = wait_s
                if self.pusher.due(step):
                    metrics.update(await self._push(step))
                offloaded = self._move_between_steps("offload")
                if offloaded is not None:
                    metrics["offload/bytes"] = float(offloaded)
                # Every rank must agree: the checkpoint is collective.
                stopping = broadcast_object(self.stop_event.is_set() or self._done(), self.info)
                saved = False
                if self.ckpt is None:
                    await self._ack()  # nothing is durable beyond the bus itself
                elif step % self.cfg.checkpoint.every_steps == 0 or stopping:
                    seconds = await self._save(final=stopping)
                    if seconds is not None:
                        metrics["time/checkpoint_s"] = seconds
                        saved = True
                step_s = time.perf_counter() - t0
                metrics["time/step_s"] = step_s
                metrics["throughput/tokens_per_s"] = metrics.get("train_tokens", 0.0) / max(
                    step_s - wait_s, 1e-9
                )
                metrics["weight_version"] = float(self.status.weight_version)
                self._report(step, metrics, trajs)
                if saved:
                    # The line first: a trainer whose ack is refused (its lease taken over,
                    # Redis cut off) has still logged the step its checkpoint holds.
                    await self._ack()
            # Stopped while waiting for data: make the steps since the last checkpoint durable.
            pending = self.ckpt is not None and self.status.step > self._checkpointed_step
            if broadcast_object(pending, self.info) and await self._save(final=True) is not None:
                await self._ack()
            ended = broadcast_object(self._ended, self.info)
            if ended is not None and not self._done():
                raise DataEnded(
                    f"no more data after step {self.status.step} (run.max_steps "
                    f"{self.run_cfg.max_steps}): {ended}"
                )
        finally:
            self.status.running = False

    async def _train(self, trajs: list[Trajectory]) -> dict[str, float]:
        try:
            return await asyncio.to_thread(train_on, trajs, self.backend, self.cfg)
        except Exception as e:
            ERRORS.labels("train_step").inc()
            if self.bus is not None:
                await self._on_train_failure(e)
            # Always a crash, the dead-lettering one too: the weights may hold part of the
            # failed step, the restart resumes from the last checkpoint, which does not.
            raise

    async def _on_train_failure(self, error: Exception) -> None:
        """Rank 0, before the crash. Groups of the failed batch on their last allowed delivery
        (`bus.max_deliveries`) go to the dead-letter stream with the error, so the restart
        goes on without them; earlier failures leave the batch to be retried (and counted).
        Everything else held (the buffer, trained steps awaiting their checkpoint) is not
        charged for this crash."""
        assert self.bus is not None
        limit = self.bus.config.max_deliveries
        groups: dict[str, list[Delivery]] = {}
        for d in self._batch:
            groups.setdefault(d.trajectory.group_id or d.trajectory_id, []).append(d)
        exhausted = [
            d
            for members in groups.values()
            if any(m.delivery_count >= limit for m in members)
            for d in members
        ]
        dead_ids = {d.entry_id for d in exhausted}
        retried = [d for d in self._batch if d.entry_id not in dead_ids]
        text = f"{type(error).__name__}: {error}"
        context = {
            "trajectories": len(self._batch),
            "max_delivery_count": max((d.delivery_count for d in self._batch), default=0),
            "max_deliveries": limit,
            "error": text[:500],
        }
        try:
            if exhausted:
                await self.bus.dead_letter(exhausted, "train_error", text)
                log.error(
                    "training failed on the last allowed delivery; the batch's groups are "
                    "dead-lettered and the restart goes on without them",
                    extra={**context, "dead_lettered": len(exhausted)},
                )
            else:
                log.error("training failed; the restart retries the batch", extra=context)
            await self.bus.forgive_held(keep=retried)
        except Exception:  # the crash that follows matters more than this bookkeeping
            log.exception("could not record the failed batch on the bus")

    def _move_between_steps(self, direction: str) -> int | None:
        """Colocated placement: `trainer.offload_between_steps` off the device after a step
        (the engines generate on it meanwhile) and back before the next; bytes moved."""
        parts = self.cfg.offload_between_steps
        if not parts:
            return None
        move = self.backend.offload if direction == "offload" else self.backend.reload
        return move(parts)

    async def _release_engines(self) -> float | None:
        """Colocated placement: the engines give their memory to this training step (sync
        rollouts: they are idle, waiting for its weights); the push after it resumes them."""
        if not self.pusher.releases_engines or self.info.rank != 0:
            return None
        try:
            return await self.pusher.release_engines()
        except Exception:
            ERRORS.labels("engine_release").inc()
            raise

    async def _push(self, step: int) -> dict[str, float]:
        """Push the weights of `step` as version `step`, retried until
        `weight_push.retry_deadline_s`; past it, WeightPushFailed stops the trainer. Going on
        instead would leave sync rollouts waiting forever for a version that never comes."""
        cfg = self.cfg.weight_push
        deadline = time.monotonic() + cfg.retry_deadline_s
        delay, failures = cfg.retry_backoff_s, 0
        while True:
            self._holds_lease()  # Redis fences acks, not the engines: a stale trainer stops here
            res, error = None, None
            try:
                res = await self.pusher.push(self.backend, step)
            except Exception as e:
                error = repr(e)
            # Only the main rank sends; every rank must agree on retrying (the gather is
            # collective).
            error = broadcast_object(error, self.info)
            if error is None:
                break
            failures += 1
            ERRORS.labels("weight_push").inc()
            if time.monotonic() + delay > deadline:
                log.error(
                    "weight push failed; giving up",
                    extra={"step": step, "attempts": failures, "error": error},
                )
                raise WeightPushFailed(
                    f"weights of step {step} not pushed after {failures} attempts "
                    f"(trainer.weight_push.retry_deadline_s={cfg.retry_deadline_s}): {error}"
                )
            log.warning(
                "weight push failed; retrying",
                extra={"step": step, "attempt": failures, "in_s": delay, "error": error},
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
        out = {"weight_push/retries": float(failures)}
        if res is None:
            return out
        self.status.weight_version = res.weight_version
        return {**out, "time/weight_push_s": res.seconds, "weight_push/bytes": float(res.bytes)}

    async def _save(self, *, final: bool = False) -> float | None:
        """Save a checkpoint; the caller acks its receipts once it is durable. A full disk is
        counted and logged once, and training goes on (the steps since the last good
        checkpoint stay unacked and go into the next one); the `final` save of a stopping run
        raises it instead: the restart resumes from the last good checkpoint. Returns the
        seconds taken, None when nothing was saved."""
        assert self.ckpt is not None
        self._holds_lease()  # the volume may be shared with the trainer that took over
        start = time.perf_counter()
        state = TrainerState(
            step=self.status.step,
            receipts=list(self._unacked),
            weight_version=self.status.weight_version,
        )
        try:
            await asyncio.to_thread(self.ckpt.save, self.backend, state)
        except CheckpointDiskFull as e:
            ERRORS.labels("checkpoint_disk_full").inc()
            if final:
                raise
            if not self._disk_full:
                log.error(
                    "checkpoint not written, disk full: training goes on, the steps since "
                    "the last good checkpoint are saved with the next one",
                    extra={"step": state.step, "error": str(e), "unacked": len(self._unacked)},
                )
            self._disk_full = True
            return None
        if self._disk_full:
            log.info("checkpoint written again after a full disk", extra={"step": state.step})
            self._disk_full = False
        self._checkpointed_step = state.step
        seconds = time.perf_counter() - start
        CHECKPOINT_SECONDS.observe(seconds)
        if self.cfg.checkpoint.export_dir:
            from pathlib import Path

            await asyncio.to_thread(self.backend.export_hf, Path(self.cfg.checkpoint.export_dir))
        return seconds

    async def _ack(self) -> None:
        if self.bus is not None and self._unacked:
            await self.bus.ack(self._unacked)
        self._unacked = []

    def _report(self, step: int, metrics: dict[str, float], trajs: list[Trajectory]) -> None:
        self.status.last_metrics = metrics
        if self.info.rank != 0:
            return
        record_step(step, metrics)
        record: dict[str, Any] = {METRICS_STEP: step, **metrics}  # the run dir's metrics file
        record[METRICS_TRAJECTORY_IDS] = [t.trajectory_id for t in trajs]
        # Which process trained it, and when: after a takeover, two trainers write this file.
        record[METRICS_TRAINER] = f"{socket.gethostname()}:{os.getpid()}"
        record[METRICS_TIME] = time.time()
        self.jsonl.write(record)
        self.sinks.write(step, metrics)
        log.info(
            "step",
            extra={
                "step": step,
                "loss": round(metrics.get("loss", 0.0), 6),
                "reward": round(metrics.get("reward/mean", 0.0), 4),
                "samples": int(metrics.get("samples", 0)),
            },
        )
