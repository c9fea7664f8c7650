"""Pushing the trainer's weights to the inference engines; the weight version is the trainer's.

A push after training step k makes the engines serve version k (the checkpointed step on a
resume), never "the engine's version + 1": the trainer's step is the one owner of the policy
version, so a failed push, a retried push or a crash between push and checkpoint cannot make
the engines' version drift from the step that produced the weights.

`disk`: export a Hugging Face directory, then `POST /update_weights_from_disk` on every engine.
`distributed`: `searchr1.weightsync.sender.WeightSender` broadcasts the tensors (gloo on CPU,
NCCL on GPU) to engines that joined its process group, driving them through the
`engine_client.client.InferenceClient`s built here.
`handover`: `searchr1.weightsync.handover.HandoverSender` hands the engines handles to the
trainer's own memory (`/update_weights_from_tensor`): engines on the same host or GPU.

Colocated placement (`release_engines_while_training`): before a training step the engines
pause and release their memory (`release_engines`); a push first resumes their weights, hands
the new ones over, then resumes the KV cache and lets generation continue (slime's
`--colocate` order).

The weight store (`weight_push.store_dir`): each version is written there while it is pushed,
so an engine that joins mid-run pulls it (`inference.join`); with `engines.discover` the push set
is `engine_urls` plus the engines announced in the registry, read again at every push.

Delta updates (`weight_push.delta`): one `searchr1.weightsync.baseline.Baseline` (the weights
the engines hold, as last sent) serves every push, whichever mode; the senders encode against
it. On disk a delta is a `delta.safetensors` directory our engine loads (SGLang: refused, it
loads Hugging Face directories).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from prometheus_client import Counter

from engine_client.client import InferenceBadRequest, InferenceClient, InferenceError
from searchr1.weightsync.baseline import Baseline, delta_capable, log_resync, write_delta_dir
from searchr1.weightsync.group import dtype_from_name
from searchr1.weightsync.handover import HandoverSender
from searchr1.weightsync.protocol import EngineRefused
from searchr1.weightsync.registry import EngineRegistry, discovered
from searchr1.weightsync.sender import WeightSender
from searchr1.weightsync.store import WeightStoreWriter
from trainer.backend import TrainerBackend
from trainer.config import PushMode, WeightPushConfig
from trainer.metrics import PUSH_SECONDS, WEIGHT_VERSION

log = logging.getLogger(__name__)
STORE_BYTES = Counter(
    "searchr1_trainer_weight_store_bytes_total",
    "Bytes written to the weight store (trainer.weight_push.store_dir), by kind: full, delta, "
    "kept (a version published again, nothing written)",
    ["kind"],
)
for _kind in ("full", "delta", "kept"):
    STORE_BYTES.labels(_kind)
STORE_FAILURES = Counter(
    "searchr1_trainer_weight_store_failures_total",
    "Versions the trainer could not write to its weight store (a full disk, an unreadable "
    "manifest): engines joining meanwhile pull an older version",
)


@dataclass(frozen=True)
class PushResult:
    weight_version: int
    seconds: float
    bytes: int


class WeightPusher:
    def __init__(
        self,
        cfg: WeightPushConfig,
        *,
        token: str | None = None,
        registry: EngineRegistry | None = None,
        run: str | None = None,
    ) -> None:
        """`registry`: engines announced there get the pushes too (`engines.discover`).
        `run`: the run's id, recorded in the weight store (engines of another run never pull
        this run's weights)."""
        if cfg.mode != PushMode.NONE and not cfg.engine_urls:
            raise ValueError(f"trainer.weight_push.mode={cfg.mode.value} needs engine_urls")
        if cfg.mode == PushMode.DISK and not cfg.disk_dir:
            raise ValueError("trainer.weight_push.mode=disk needs disk_dir")
        self.cfg = cfg
        self.token = token
        self._sender: WeightSender | None = None
        # The tags the engines may hold released, which the next push resumes (each once: a
        # retried push does not resume again). Our engine answers "not released" to a needless
        # resume, so at start-up all are assumed (a crashed predecessor may have left them
        # released); SGLang drops the connection and dies instead, so it is resumed only after
        # this trainer's own release.
        ours = cfg.handover_format == "searchr1"
        self._released = set(cfg.release_tags) if self.releases_engines and ours else set()
        self.baseline = (
            Baseline(verify_every=cfg.delta_verify_every) if delta_enabled(cfg) else None
        )
        self.registry = registry
        self.urls = list(cfg.engine_urls)  # the push set: engine_urls + announced engines
        self.store = (
            WeightStoreWriter(
                cfg.store_dir,
                run=run,
                full_every=cfg.store_full_every,
                keep_full=cfg.store_keep_full,
            )
            if cfg.store_dir
            else None
        )
        self._store_dtype: torch.dtype | None = None

    @property
    def enabled(self) -> bool:
        return self.cfg.mode != PushMode.NONE

    @property
    def releases_engines(self) -> bool:
        return self.cfg.release_engines_while_training

    def _clients(self, deadline_s: float | None = None) -> list[InferenceClient]:
        return [InferenceClient(u, token=self.token, deadline_s=deadline_s) for u in self.urls]

    async def refresh_engines(self) -> list[str]:
        """The push set read again (main rank): `engine_urls` plus the engines announced in
        the registry; a distributed sender gets the new set (its next push makes a new group)."""
        urls = await discovered(self.registry, self.cfg.engine_urls)
        if urls != self.urls:
            log.info("engines changed", extra={"engines": urls, "were": self.urls})
            self.urls = urls
            if self._sender is not None:
                await self._sender.set_engines(self._clients(deadline_s=self.cfg.timeout_s))
        return self.urls

    async def release_engines(self) -> float:
        """Colocated placement, before a training step (main rank): generation paused (running
        requests retracted, to run again after the push) and the engines' memory freed for the
        trainer. Returns the seconds it took."""
        start = time.perf_counter()
        clients = self._clients()
        try:
            await asyncio.gather(*(c.pause_generation("retract") for c in clients))
            tags = list(self.cfg.release_tags)
            self._released |= set(tags)
            await asyncio.gather(*(c.release_memory_occupation(tags) for c in clients))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        return time.perf_counter() - start

    async def _resume(self, clients: list[InferenceClient], tags: list[str]) -> None:
        """Resume those of `tags` that may be released, one at a time; "not released" is fine
        (a trainer restarted after a crash does not know what its predecessor released)."""
        for tag in (t for t in tags if t in self._released):
            results = await asyncio.gather(
                *(c.resume_memory_occupation([tag]) for c in clients), return_exceptions=True
            )
            for r in results:
                if isinstance(r, InferenceBadRequest) and "not released" in str(r):
                    continue
                if isinstance(r, BaseException):
                    raise r
            self._released.discard(tag)

    def due(self, step: int) -> bool:
        return self.enabled and step % self.cfg.every_steps == 0

    async def connect(self) -> None:
        if self.cfg.mode != PushMode.DISTRIBUTED:
            return
        if self._sender is None:
            # One sender for the trainer's life: its rendezvous store holds master_port, and a
            # reconnect after a failure reuses it.
            self._sender = WeightSender(
                self._clients(deadline_s=self.cfg.timeout_s),
                master_addr=self.cfg.master_addr,
                master_port=self.cfg.master_port,
                backend=self.cfg.backend,
                bucket_bytes=self.cfg.bucket_bytes,
                dtype=dtype_from_name(self.cfg.dtype) if self.cfg.dtype else None,
                baseline=self.baseline,
                timeout_s=self.cfg.timeout_s,
            )
        if not self._sender.connected:
            await self._sender.connect()

    async def push(self, backend: TrainerBackend, step: int) -> PushResult | None:
        """Collective over trainer ranks (gathering full tensors); the main rank sends."""
        start = time.perf_counter()
        if backend.is_main:
            await self.refresh_engines()
        named: list[tuple[str, Any]] | None = None
        publishing: asyncio.Task[None] | None = None
        if self.store is not None:  # collective (every rank gathers), the main rank writes
            named = await asyncio.to_thread(lambda: list(backend.named_tensors()))
            if backend.is_main:
                publishing = asyncio.create_task(self._publish(named, step))
        try:
            result = await self._push(backend, step, named, start)
        finally:
            if publishing is not None:
                await publishing
        baseline = self.baseline
        if result is not None and self.store and baseline and baseline.version == step:
            try:  # joiners at this version take the pusher's delta state
                await asyncio.to_thread(self.store.set_state, step, baseline.state)
            except Exception as e:
                STORE_FAILURES.inc()
                log.error("weight store state not recorded", extra={"error": repr(e)})
        return result

    async def _push(
        self,
        backend: TrainerBackend,
        step: int,
        named: list[tuple[str, Any]] | None,
        start: float,
    ) -> PushResult | None:
        if self.cfg.mode == PushMode.DISK and self.baseline is not None:
            if named is None:
                named = await asyncio.to_thread(lambda: list(backend.named_tensors()))
            if not backend.is_main:
                return None
            version, nbytes = await self._disk_delta(named, step)
        elif self.cfg.mode == PushMode.DISK:
            assert self.cfg.disk_dir is not None
            out = await asyncio.to_thread(
                backend.export_hf, Path(self.cfg.disk_dir) / f"step_{step:08d}"
            )
            if out is None:
                return None
            version, nbytes = await self._update_from_disk(str(out), step), _dir_bytes(out)
        else:
            if named is None:
                named = await asyncio.to_thread(lambda: list(backend.named_tensors()))
            if not backend.is_main:
                return None
            if self.cfg.mode == PushMode.HANDOVER:
                version, nbytes = await self._hand_over(named, step)
            else:
                try:
                    await self.connect()
                    assert self._sender is not None
                    stats = await self._sender.push(named, version=step)
                except Exception:
                    # The weight group may be broken (an engine restarted): a new one next time.
                    if self._sender is not None:
                        self._sender.disconnect()
                    raise
                version, nbytes = int(stats.weight_version), int(stats.bytes)
        seconds = time.perf_counter() - start
        PUSH_SECONDS.observe(seconds)
        WEIGHT_VERSION.set(version)
        log.info(
            "weights pushed",
            extra={"step": step, "weight_version": version, "seconds": seconds, "bytes": nbytes},
        )
        return PushResult(version, seconds, nbytes)

    async def _publish(self, named: list[tuple[str, Any]], step: int) -> None:
        """Write version `step` to the weight store, on a worker thread while the push runs
        (the push returns once both are done). An engine that joins while it is written gets
        the version before and is brought up by the resync check (`resync_check_s`). A failure
        is counted and logged, not raised: the engines got the weights; joiners wait for the
        next version that is written."""
        try:
            await self._write(named, step)
        except Exception as e:
            STORE_FAILURES.inc()
            log.error("weight store not written", extra={"step": step, "error": repr(e)})

    async def _write(self, named: list[tuple[str, Any]], step: int) -> None:
        assert self.store is not None
        if self._store_dtype is None:
            name = self.cfg.dtype
            if name is None:
                async with InferenceClient(self.urls[0], token=self.token) as c:
                    name = (await c.get_model_info()).get("dtype")
            if name is None:
                raise ValueError(
                    "trainer.weight_push.store_dir needs the engines' dtype: set "
                    "trainer.weight_push.dtype (SGLang does not report it)"
                )
            self._store_dtype = dtype_from_name(name)
        out = await asyncio.to_thread(self.store.publish, step, named, dtype=self._store_dtype)
        STORE_BYTES.labels(out.kind).inc(out.bytes)

    async def _hand_over(self, named: list[tuple[str, Any]], step: int) -> tuple[int, int]:
        clients = self._clients()
        release = self.releases_engines
        try:
            # Weights (and graphs) back before the update; the KV cache after it, as slime does.
            await self._resume(clients, [t for t in self.cfg.release_tags if t != "kv_cache"])
            sender = HandoverSender(
                clients,
                format=self.cfg.handover_format,
                device=named[0][1].device if named else "cpu",
                bucket_bytes=self.cfg.bucket_bytes,
                # Released engines are paused already: generation resumes after the KV cache.
                pause_mode=None if release else "retract",
                dtype=dtype_from_name(self.cfg.dtype) if self.cfg.dtype else None,
                tp_size=self.cfg.handover_tp_size,
                baseline=self.baseline,
            )
            if release and "weights" in self.cfg.release_tags and self.baseline is not None:
                self.baseline.invalidate()  # released and resumed: nothing to encode against
            stats = await sender.push(named, version=step)
            if release:
                await self._resume(clients, ["kv_cache"])
                await asyncio.gather(*(c.continue_generation() for c in clients))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        return int(stats.weight_version), int(stats.bytes)

    async def _disk_delta(self, named: list[tuple[str, Any]], step: int) -> tuple[int, int]:
        """A delta directory (full where the engines do not hold the baseline), loaded by every
        engine; a refused delta is written and loaded again in full."""
        assert self.baseline is not None and self.cfg.disk_dir is not None
        out = Path(self.cfg.disk_dir) / f"step_{step:08d}"
        clients = self._clients()
        try:
            infos = await asyncio.gather(*(c.get_model_info() for c in clients))
            if not delta_capable(infos):
                raise ValueError(
                    "trainer.weight_push.delta on with mode disk needs our engines (SGLang loads "
                    "Hugging Face directories): set delta off"
                )
            name = self.cfg.dtype or infos[0].get("dtype")
            dtype = dtype_from_name(name) if name else None
            delta = self.baseline.usable([int(i["weight_version"]) for i in infos])
            for attempt in (True, False) if delta else (False,):
                update = self.baseline.begin(step, delta=attempt)
                nbytes = await asyncio.to_thread(write_delta_dir, out, named, update, dtype)
                try:
                    await asyncio.gather(
                        *(c.update_weights_from_disk(str(out), version=step) for c in clients)
                    )
                except EngineRefused as e:
                    if not attempt:
                        raise
                    log_resync(e, self.urls)
                    continue
                update.commit()
                return step, nbytes
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        raise AssertionError("unreachable: the full attempt returns or raises")

    async def _update_from_disk(self, path: str, version: int) -> int:
        clients = self._clients()
        try:
            versions = await asyncio.gather(
                *(c.update_weights_from_disk(path, version=version) for c in clients)
            )
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        return max(versions)

    async def engines_behind(self, version: int) -> list[str]:
        """Engines that answer with a version below `version` (restarted, or a push that never
        reached them); an engine that does not answer is not counted (it may be starting)."""

        async def behind(url: str) -> bool:
            async with InferenceClient(url, token=self.token, timeout_s=10, max_retries=0) as c:
                try:
                    return (await c.get_model_info())["weight_version"] < version
                except InferenceError:
                    return False

        urls = await self.refresh_engines()
        flags = await asyncio.gather(*(behind(u) for u in urls))
        return [u for u, f in zip(urls, flags, strict=True) if f]

    async def close(self) -> None:
        if self._sender is not None:
            await self._sender.close()
            self._sender = None
        if self.registry is not None:
            await self.registry.aclose()


def delta_enabled(cfg: WeightPushConfig) -> bool:
    """`weight_push.delta` resolved: auto is on only where a network link carries the weights
    (gloo to engines on other hosts); on loopback, over NCCL and in memory the CPU encoding
    costs more than the bytes it saves (docs/benchmarks.md)."""
    if cfg.mode == PushMode.NONE or cfg.delta == "off":
        return False
    if cfg.delta == "on":
        return True
    loopback = all(_is_loopback(u) for u in cfg.engine_urls)
    return cfg.mode == PushMode.DISTRIBUTED and cfg.backend == "gloo" and not loopback


def _is_loopback(url: str) -> bool:
    host = urlsplit(url if "://" in url else f"http://{url}").hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))
