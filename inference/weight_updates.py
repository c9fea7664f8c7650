"""The engine's weight updates: from disk, by broadcast (`searchr1.weightsync.receiver`) and by
hand-over (`searchr1.weightsync.handover_receiver`), with SGLang's session around the last two
(`begin_weight_update` .. `end_weight_update`).

Everything that touches the model runs as a scheduler command, between decode steps; every call
renews the pause lease (`inference.pause`): the trainer is alive. The served version changes
when the weights do: at a disk load, or at the session's end with the last version an update of
the session carried. Every change drops the prefix cache (its K/V came from the old weights).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from inference.memory import MemoryState
from inference.pause import PauseLease
from inference.scheduler import Scheduler
from searchr1.weightsync.handover import Handover
from searchr1.weightsync.handover_receiver import HandoverReceiver
from searchr1.weightsync.protocol import Bucket, GroupJoin
from searchr1.weightsync.receiver import WeightLoader


class WeightUpdates:
    """The weight-update calls of one engine, run through its scheduler."""

    def __init__(
        self,
        loader: WeightLoader,
        scheduler: Scheduler,
        memory: MemoryState,
        pause: PauseLease,
        model_path: str,
    ) -> None:
        self.loader = loader
        self.handovers = HandoverReceiver(loader, memory)
        self.scheduler = scheduler
        self.memory = memory
        self.pause = pause
        self.model_path = model_path  # where the served weights came from
        self._session_version: int | None = None  # carried by the open update session

    def drop_session(self) -> bool:
        """Scheduler thread: forget the open session (its pause ran out); whether one was."""
        dropped = self.loader.session is not None
        self.loader.session = None
        self._session_version = None
        return dropped

    async def from_disk(self, model_path: str, version: int | None = None) -> int:
        """Load a checkpoint; the served version becomes `version` (unchanged when None, as
        in SGLang). Returns the version."""

        def do() -> int:
            self.memory.require_weights("update_weights_from_disk")
            try:
                self.loader.load_from_disk(Path(model_path))
            finally:  # even a failed load may have changed some weights: nothing cached stays
                self.scheduler.flush_prefix_cache()
            self.memory.weights_loaded()
            self.model_path = str(model_path)
            return self.scheduler.set_version(version)

        return await self.scheduler.run_command(do)

    async def begin(self) -> None:
        """Open a weight-update session (SGLang's protocol around distributed updates)."""

        def do() -> None:
            self.pause.renew()
            self.memory.require_weights("begin_weight_update")
            self.loader.begin_session()

        await self.scheduler.run_command(do)

    async def end(self) -> int:
        """Close the session: every bucket received in it becomes the served weights at once
        (none if one was rejected), with the last version an update of the session carried."""

        def do() -> int:
            self.pause.renew()
            version, self._session_version = self._session_version, None
            try:
                self.loader.end_session()
            finally:
                self.scheduler.flush_prefix_cache()
            self.memory.weights_loaded()
            return self.scheduler.set_version(version)

        return await self.scheduler.run_command(do)

    async def init_group(self, join: GroupJoin) -> None:
        # Joining blocks until every rank arrives: not on the scheduler thread.
        await asyncio.to_thread(self.loader.init_group, join)

    async def destroy_group(self, group_name: str) -> None:
        await asyncio.to_thread(self.loader.destroy_group, group_name)

    async def from_distributed(self, bucket: Bucket, version: int | None = None) -> int:
        """Receive one bucket into the open session; applied by `end`.

        Received on a worker thread, not the scheduler's: it only stages tensors, and a sender
        that dies mid-broadcast blocks it until the group's timeout, which must not stall
        generation (the pause lease resumes it meanwhile)."""
        await self.scheduler.run_command(self.pause.renew)
        session = self.loader.session
        await asyncio.to_thread(self.loader.receive, bucket)

        def done() -> int:
            self.pause.renew()
            # Not if the lease ran out meanwhile: that push was dropped with its session.
            if version is not None and self.loader.session is session:
                self._session_version = version
            return self.scheduler.weight_version

        return await self.scheduler.run_command(done)

    async def from_tensor(
        self, handover: Handover, version: int | None = None, *, flush_cache: bool = True
    ) -> int:
        """Copy one handed-over bucket into the weights (inside the open session; see
        `searchr1.weightsync.handover_receiver`); `version` is served from the session's end."""

        def do() -> int:
            self.pause.renew()
            try:
                self.handovers.apply(handover)
            finally:  # even a refused bucket may follow applied ones: nothing cached stays
                if flush_cache:
                    self.scheduler.flush_prefix_cache()
            if version is not None:
                self._session_version = version
            return self.scheduler.weight_version

        return await self.scheduler.run_command(do)
