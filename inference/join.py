"""An engine that joins a running run by pulling: the current weights from the trainer's weight
store (`searchr1.weightsync.store`), then an announcement (`searchr1.weightsync.registry`) that
puts it in the trainer's push set and the orchestrator's pool.

At start-up (`inference.join.store_dir` set) the engine reads the newest version (a full
snapshot and the deltas after it), loads it as a scheduler command, checks its own weights
against the trainer's checksum, and reads the manifest again: a version published meanwhile
is brought in from the deltas since. Only when it holds the newest version does `/ready` pass
(its `weights` check) and the engine announce itself (`inference.join.announce`). The engines
already serving are not involved: nothing is asked of the trainer. A store with nothing in it
yet (the run has not pushed) means the initial weights are current. A corrupt store entry is
refused (counted in `searchr1_weight_store_errors_total`, named in `/ready`) and read again
every `poll_s` (the trainer's next version may replace it); a push that reaches the engine
first wins (the pull does not take it back a version).

The weights' delta state (`receiver.WeightLoader.state`) is the pusher's for that version when
the trainer recorded it in the manifest, so the trainer's next delta push applies here too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from inference.config import JoinConfig
from searchr1.weightsync.delta import state_checksum
from searchr1.weightsync.registry import Announcement, EngineRegistry
from searchr1.weightsync.store import Snapshot, StoreEmpty, WeightStoreReader

if TYPE_CHECKING:
    from inference.engine import TorchEngine

log = logging.getLogger(__name__)

JOINS = Counter(
    "searchr1_inference_join_total",
    "Pulls from the weight store at start-up, by outcome (ok, empty: nothing published yet, "
    "error: refused or unreadable, retried)",
    ["outcome"],
)
JOIN_SECONDS = Gauge("searchr1_inference_join_seconds", "Seconds from start to the pulled version")
JOIN_BYTES = Gauge("searchr1_inference_join_bytes", "Bytes read from the weight store to join")
for _outcome in ("ok", "empty", "error"):
    JOINS.labels(_outcome)


class Joiner:
    def __init__(
        self,
        engine: TorchEngine,
        cfg: JoinConfig,
        *,
        advertise_url: str,
        registry: EngineRegistry | None = None,
        run: str | None = None,
    ) -> None:
        """`run`: this run's id: a store of another run's weights is not pulled."""
        if cfg.announce and registry is None:
            raise ValueError("inference.join.announce needs redis.url (the engine registry)")
        self.engine = engine
        self.cfg = cfg
        self.advertise_url = advertise_url
        self.registry = registry
        self.reader = WeightStoreReader(cfg.store_dir, run=run) if cfg.store_dir else None
        self.ready = self.reader is None
        self.detail = "starting"
        self.version: int | None = None
        self.bytes_read = 0
        self._announcement: Announcement | None = None

    async def check(self) -> str:
        """The `/ready` check: passes once the engine holds the store's newest version."""
        if not self.ready:
            raise RuntimeError(self.detail)
        return self.detail

    async def run(self) -> None:
        """Pull until the newest version is held, then announce (retried until they work)."""
        start = time.monotonic()
        while not self.ready:
            try:
                await self._pull()
            except Exception as e:  # a corrupt entry, a model that does not fit: tried again
                JOINS.labels("error").inc()
                self.detail = f"pulling from {self.cfg.store_dir} failed: {e}"
                log.error("weight store pull failed", extra={"error": str(e)})
                await asyncio.sleep(self.cfg.poll_s)
        JOIN_SECONDS.set(time.monotonic() - start)
        while self.cfg.announce and self._announcement is None:
            assert self.registry is not None
            announcement = Announcement(self.registry, self.advertise_url, self.cfg.announce_ttl_s)
            try:
                await announcement.start()
                self._announcement = announcement
            except Exception as e:
                self.detail = f"announcing {self.advertise_url} failed: {e}"
                log.warning("engine announcement failed", extra={"error": str(e)})
                await asyncio.sleep(self.cfg.poll_s)

    async def _pull(self) -> None:
        assert self.reader is not None
        reader, dtype = self.reader, self.engine.dtype
        snap: Snapshot | None = None
        while True:
            try:
                snap = await asyncio.to_thread(reader.read, have=snap, dtype=dtype)
            except StoreEmpty:
                JOINS.labels("empty").inc()
                self.detail = f"nothing in {self.cfg.store_dir} yet: the initial weights"
                self.ready = True
                return
            self.detail = f"pulled v{snap.version} ({snap.files} files); loading"
            self.bytes_read += snap.bytes_read
            JOIN_BYTES.set(self.bytes_read)
            loaded = await self.engine.run_command(lambda s=snap: self._load(s))
            if await asyncio.to_thread(reader.latest_version) == snap.version:
                break
        self.version = snap.version
        self.ready = True
        JOINS.labels("ok").inc()
        how = "pulled" if loaded else "a push got there first"
        self.detail = f"v{self.engine.weight_version} ({how}; store v{snap.version})"
        log.info(
            "joined from the weight store",
            extra={"version": snap.version, "bytes": self.bytes_read, "loaded": loaded},
        )

    def _load(self, snap: Snapshot) -> bool:
        """Scheduler thread: the snapshot becomes the served weights, checked against the
        trainer's checksum; False when the engine already serves that version or newer."""
        engine = self.engine
        if engine.weight_version >= snap.version:
            return False
        engine.memory.require_weights("joining from the weight store")
        loader = engine.weights
        params = loader.check({n: (t.shape, t.dtype) for n, t in snap.tensors.items()})
        wrong = [n for n, t in snap.tensors.items() if params[n].dtype != t.dtype]
        if wrong:
            raise ValueError(f"the store's dtype is not the engine's: {wrong[:5]}")
        try:
            loader.apply(params, snap.tensors)
            loader.state = None
            got = state_checksum((n, params[n].detach()) for n in snap.tensors)
            if got != snap.checksum:
                raise ValueError(
                    f"weights after the pull: checksum {got}, trainer's {snap.checksum}"
                )
        finally:
            engine.scheduler.flush_prefix_cache()
        loader.state = snap.state
        engine.memory.weights_loaded()
        engine.updates.model_path = f"{self.cfg.store_dir} v{snap.version}"
        engine.scheduler.set_version(snap.version)
        return True

    async def stop(self) -> None:
        """Withdraw the announcement (the trainer stops pushing here)."""
        if self._announcement is not None:
            await self._announcement.stop()
            self._announcement = None
        if self.registry is not None:
            await self.registry.aclose()
