"""Trainer side of live weight updates: broadcast parameters to inference engines.

`WeightSender.connect()` creates a process group of its own (see `searchr1.weightsync.group`):
the sender is rank 0 and engine i joins as rank i + 1 through `POST /init_weights_update_group`.
`push(named_tensors)` then
  1. pauses the engines (`pause_mode`, default "retract": running requests keep their tokens
     and recompute their KV under the new weights), so no decode step runs on a half-updated
     model;
  2. opens a weight-update session on every engine (`/begin_weight_update`; SGLang 0.5.21
     refuses distributed updates outside one; a server without the route needs none; steps 1,
     2 and 4 are `session.update_session`, which the hand-over sender runs too);
  3. per bucket of at most `bucket_bytes`: posts `/update_weights_from_distributed` (names,
     dtypes, shapes) to every engine, broadcasts each tensor of the bucket in order in the
     engines' dtype, and waits for every answer; only the last bucket carries the new weight
     version, so a push moves the version once;
  4. closes the sessions (`/end_weight_update`) and resumes the engines, whatever happened.
The same code drives SGLang (NCCL on GPU, gloo on CPU) and our reference engine, through the
engine clients the caller hands in (`protocol.WeightEngine`:
`engine_client.client.InferenceClient`); an engine's refusal is a `protocol.EngineRefused`.

With a `baseline.Baseline` (delta updates), a push to our engines sends each bucket as one
uint8 broadcast of per-tensor payloads (`delta`: full bytes, nothing, XOR+zstd or sparse) with
a `protocol.DeltaHeader`; the next bucket is encoded on a worker thread while one is on the
wire. SGLang engines (no delta route) get the plain tensors, as without a baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from searchr1.weightsync.baseline import Baseline, Update, delta_capable, log_resync
from searchr1.weightsync.group import (
    abandon_weight_group,
    destroy_weight_group,
    dtype_from_name,
    dtype_name,
    host_store,
    new_weight_group,
    reap_abandoned_groups,
    store_client,
)
from searchr1.weightsync.protocol import Bucket, EngineRefused, GroupJoin, WeightEngine
from searchr1.weightsync.session import PushStats, update_session, with_last

log = logging.getLogger(__name__)


class WeightSender:
    """Rank 0 of a weight group with `engines`; it owns them (`close()` closes them)."""

    def __init__(
        self,
        engines: Sequence[WeightEngine],
        *,
        master_addr: str = "127.0.0.1",
        master_port: int,
        backend: str = "gloo",
        group_name: str = "searchr1-weights",
        bucket_bytes: int = 256 << 20,
        pause_mode: str | None = "retract",
        dtype: torch.dtype | None = None,
        timeout_s: float = 600.0,
        baseline: Baseline | None = None,
    ) -> None:
        """`baseline`: send delta updates to our engines, encoded against it (None: plain)."""
        if not engines:
            raise ValueError("engines is empty")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl (got {backend!r})")
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be > 0")
        self.master_addr = master_addr
        self.master_port = master_port
        self.backend = backend
        self.base_group_name = group_name
        self.group_name = group_name  # the registered name: set per connection
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        self._dtype = dtype
        self.baseline = baseline
        self._clients = list(engines)
        self._group: Any = None
        # Set once the collective last started on `_group` has ended (None: none started):
        # handed to `abandon_weight_group` with the group, which is destroyed once it is set.
        self._collective: threading.Event | None = None
        self._store: Any = None  # the rendezvous server on master_port, from the first connect
        self.refusal_grace_s = 5.0
        self._abandoned: list[
            str
        ] = []  # groups given up; the engines free them at the next connect

    async def connect(self) -> None:
        """Create the group: engines join as ranks 1..N, this process is rank 0."""
        reap_abandoned_groups()
        world = len(self._clients) + 1
        # A fresh name per connection: a group that a failed push could not tear down (its
        # collective thread is still blocked) stays registered under its name in this
        # process, and reusing that name would make every later connect fail.
        self.group_name = f"{self.base_group_name}-{secrets.token_hex(4)}"
        if self._store is None:
            self._store = host_store(self.master_addr, self.master_port, self.timeout_s)
            # master_port 0: the OS chose a free port; the engines learn it from the join.
            # (A fixed port can be taken meanwhile by any process's outgoing connection.)
            self.master_port = int(self._store.port)
        host = _in_daemon_thread(
            functools.partial(
                new_weight_group,
                store=store_client(self.master_addr, self.master_port, self.timeout_s),
                backend=self.backend,
                master_address=self.master_addr,
                master_port=self.master_port,
                world_size=world,
                rank=0,
                group_name=self.group_name,
                timeout_s=self.timeout_s,
            )
        )
        joins = asyncio.gather(
            *(
                c.init_weights_update_group(
                    GroupJoin(
                        master_address=self.master_addr,
                        master_port=self.master_port,
                        rank_offset=i + 1,
                        world_size=world,
                        group_name=self.group_name,
                        backend=self.backend,
                    )
                )
                for i, c in enumerate(self._clients)
            ),
            return_exceptions=True,
        )
        # Whichever side fails first fails the connect: if our own rank 0 fails, the engines
        # would wait for it until their timeout; if an engine cannot join (not up yet), our
        # rank 0 would.
        await asyncio.wait({host, joins}, return_when=asyncio.FIRST_COMPLETED)
        if host.done() and host.exception() is not None:
            joins.cancel()
            raise host.exception()  # type: ignore[misc]
        if joins.done():
            errors = [r for r in joins.result() if isinstance(r, BaseException)]
            if errors:
                # Our rank 0 stays blocked in its join until the timeout: a daemon thread, it
                # does not keep the process alive, and its group name is never reused. It
                # waits on the rendezvous server, which must outlive it: torn down under it
                # (the sender collected, the interpreter exiting), the thread's C++ wait
                # fails and aborts the process (SIGABRT, "terminate called").
                _keep_forever(self._store)
                host.add_done_callback(_observe)
                raise errors[0]
        self._group, self._collective = await host, None
        # Every rank is in the group, but an engine registers it under its name only when its
        # join returns: a bucket sent before that is refused ("call init first").
        errors = [r for r in await joins if isinstance(r, BaseException)]
        if errors:
            destroy_weight_group(self._group)
            self._group = None
            raise errors[0]
        if self._dtype is None:
            info = await self._clients[0].get_model_info()
            self._dtype = dtype_from_name(info["dtype"]) if info.get("dtype") else None
        log.info("weight group ready", extra={"engines": len(self._clients)})
        # Only now: an engine that could not join the new group keeps the old ones it has.
        await self._destroy_on_engines(self._abandoned)
        self._abandoned.clear()

    async def _destroy_on_engines(self, names: list[str]) -> None:
        """Best effort: each engine frees these groups (sockets, NCCL communicators). A group an
        engine no longer has (it restarted, or freed it itself) is not an error."""
        for name in names:
            results = await asyncio.gather(
                *(c.destroy_weights_update_group(name) for c in self._clients),
                return_exceptions=True,
            )
            for c, r in zip(self._clients, results, strict=True):
                if isinstance(r, BaseException):
                    log.warning(
                        "could not destroy a weight group on an engine",
                        extra={"engine": c.base_url, "group": name, "error": repr(r)},
                    )

    def _buckets(
        self, named: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in named:
            t = t.detach()
            if self._dtype is not None and t.is_floating_point():
                t = t.to(self._dtype)
            t = t.to(self.device).contiguous()
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += nbytes
        if bucket:
            yield bucket

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        works = [dist.broadcast(t, src=0, group=self._group, async_op=True) for t in tensors]
        # Every work is waited for, even after one failed (a failed collective breaks the group:
        # gloo closes its pairs, so the later ones fail at once): none is in flight once this
        # returns, and the group may then be destroyed (`abandon_weight_group`). No work is
        # left in this frame, which a failure's traceback keeps: a live work keeps the group's
        # sockets open after the group is destroyed.
        first: Exception | None = None
        while works:
            try:
                works.pop(0).wait()
            except Exception as e:
                first = first or e
        if first is not None:
            try:
                raise first
            finally:
                first = None  # no cycle through this frame: the error is freed with its holder

    async def _broadcast_watching(self, tensors: list[torch.Tensor], calls: list[Any]) -> None:
        """Broadcast; if an engine refuses before receiving, the broadcast can never finish:
        then give up on the group (abort it) instead of hanging until its timeout."""
        self._collective = threading.Event()
        send = _in_daemon_thread(
            functools.partial(self._broadcast, tensors), ended=self._collective
        )
        try:
            await self._watch(send, calls)
        except BaseException:
            # The push failed (a refusal, the collective itself: an engine killed mid-push, or
            # its deadline): the collective and the engines' calls still running end later,
            # failing, and nobody waits for them.
            for fut in (send, *calls):
                fut.add_done_callback(_observe)
            raise

    async def _watch(self, send: asyncio.Future[Any], calls: list[Any]) -> None:
        pending = {send, *calls}
        while not send.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            refused = [t for t in done if t is not send and t.exception() is not None]
            if refused and not send.done():
                finished, _ = await asyncio.wait({send}, timeout=self.refusal_grace_s)
                if not finished:
                    # Given up here, and its name kept for the engines to free at the next
                    # connect (the trainer's own disconnect() then finds no group).
                    self.disconnect()
                    # The stuck collective ends later, failing: expected, and nobody waits
                    # for it any more (the calls: `_broadcast_watching`).
                    send.cancel()
                    raise EngineRefused(
                        f"an engine refused the update before receiving it "
                        f"({refused[0].exception()}); the weight group is closed, reconnect"
                    )
        await send

    async def push(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None
    ) -> PushStats:
        """Send every tensor to every engine; returns bytes, seconds and the new version.

        `version` is the weight version the engines serve afterwards; by default one more than
        the highest version any engine reports. With a baseline: a delta where every engine
        holds it, else full; a refused delta is resent in full at once."""
        reap_abandoned_groups()
        if self._group is None:
            raise RuntimeError("call connect() first")
        if self.baseline is None:
            return await self._push(named_tensors, version, None)
        named = list(named_tensors)
        infos = await asyncio.gather(*(c.get_model_info() for c in self._clients))
        if version is None:
            version = max(i["weight_version"] for i in infos) + 1
        if not delta_capable(infos):
            return await self._push(named, version, None)
        delta = self.baseline.usable([i["weight_version"] for i in infos])
        try:
            return await self._push(named, version, self.baseline.begin(version, delta=delta))
        except EngineRefused as e:
            if not delta or self._group is None:
                raise
            log_resync(e, [c.base_url for c in self._clients])
        return await self._push(named, version, self.baseline.begin(version, delta=False))

    async def _push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None,
        update: Update | None,
    ) -> PushStats:
        if version is None:
            infos = await asyncio.gather(*(c.get_model_info() for c in self._clients))
            version = max(i["weight_version"] for i in infos) + 1
        async with update_session(self._clients, self.pause_mode) as timing:
            if update is None:
                total = await self._send_buckets(named_tensors, version)
            else:
                total = await self._send_delta(list(named_tensors), version, update)
        seconds, paused = timing.seconds, timing.paused_seconds
        if update is not None:
            update.commit()
        stats = PushStats(
            total,
            seconds,
            version,
            paused_seconds=paused,
            raw_bytes=update.raw_bytes if update else None,
            delta=bool(update and update.delta),
        )
        log.info(
            "weights pushed",
            extra={
                "bytes": total,
                "delta": stats.delta,
                "seconds": round(seconds, 3),
                "paused_seconds": round(paused, 3),
                "version": version,
                "gb_per_s": round(stats.gbytes_per_s, 3),
            },
        )
        return stats

    async def _send_buckets(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> int:
        """Every bucket to every engine; the first rejected bucket stops the push (later ones
        would be rejected the same way). Returns the bytes sent."""
        total = 0
        for bucket, last in with_last(self._buckets(named_tensors)):
            names = [n for n, _ in bucket]
            tensors = [t for _, t in bucket]
            calls = [
                asyncio.create_task(
                    c.update_weights_from_distributed(
                        Bucket(
                            names=names,
                            dtypes=[dtype_name(t.dtype) for t in tensors],
                            shapes=[list(t.shape) for t in tensors],
                            group_name=self.group_name,
                            weight_version=str(version) if last else None,
                        )
                    )
                )
                for c in self._clients
            ]
            await self._broadcast_watching(tensors, calls)
            results = await asyncio.gather(*calls, return_exceptions=True)
            total += sum(t.numel() * t.element_size() for t in tensors)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        return total

    def _plan(self, named: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
        """Buckets of at most `bucket_bytes` in the engines' dtype (before encoding): known up
        front, so the last one is known before the first is sent."""
        parts: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for name, t in named:
            item = self._dtype.itemsize if self._dtype and t.is_floating_point() else None
            nbytes = t.numel() * (item or t.element_size())
            if parts[-1] and size + nbytes > self.bucket_bytes:
                parts.append([])
                size = 0
            parts[-1].append((name, t))
            size += nbytes
        return parts if parts[-1] else []

    def _encode(
        self, part: list[tuple[str, torch.Tensor]], update: Update, version: int, last: bool
    ) -> tuple[Bucket, torch.Tensor]:
        """One bucket's header and its payloads as one uint8 tensor (worker thread)."""
        names, dtypes, shapes, encodings, payloads = [], [], [], [], []
        for name, t in part:
            held, encoding, payload = update.encode(name, t, self._dtype)
            names.append(name)
            dtypes.append(dtype_name(held.dtype))
            shapes.append(list(held.shape))
            encodings.append(encoding)
            payloads.append(payload)
        header = update.header(encodings, [p.numel() for p in payloads], last=last)
        blob = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8)
        bucket = Bucket(
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=self.group_name,
            weight_version=str(version) if last else None,
            delta=header,
        )
        return bucket, blob.to(self.device)

    async def _send_delta(
        self, named: list[tuple[str, torch.Tensor]], version: int, update: Update
    ) -> int:
        """Like `_send_buckets`, each bucket one broadcast of its encoded payloads; bucket k+1
        is encoded while bucket k is on the wire and being decoded."""
        plan = self._plan(named)
        total = 0
        encoding: asyncio.Future[tuple[Bucket, torch.Tensor]] | None = None
        try:
            for i, part in enumerate(plan):
                if encoding is None:
                    encoding = asyncio.ensure_future(
                        asyncio.to_thread(self._encode, part, update, version, i == len(plan) - 1)
                    )
                bucket, blob = await encoding
                encoding = None
                if i + 1 < len(plan):
                    last = i + 2 == len(plan)
                    encoding = asyncio.ensure_future(
                        asyncio.to_thread(self._encode, plan[i + 1], update, version, last)
                    )
                calls = [
                    asyncio.create_task(c.update_weights_from_distributed(bucket))
                    for c in self._clients
                ]
                await self._broadcast_watching([blob] if blob.numel() else [], calls)
                results = await asyncio.gather(*calls, return_exceptions=True)
                total += blob.numel()
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors:
                    raise errors[0]
        finally:
            if encoding is not None:  # a failed bucket: the next one's encoding is not needed
                encoding.add_done_callback(_observe)
        return total

    @property
    def connected(self) -> bool:
        return self._group is not None

    def disconnect(self) -> None:
        """Give the current group up after a failed push (a collective may be stuck in it);
        the next `connect()` makes a new one on the same rendezvous store; the group itself is
        destroyed at the next connect or push after that collective has ended."""
        group, self._group = self._group, None
        if group is not None:
            abandon_weight_group(group, self._collective)
            self._abandoned.append(self.group_name)

    @property
    def engines(self) -> list[WeightEngine]:
        return list(self._clients)

    async def set_engines(self, engines: Sequence[WeightEngine]) -> None:
        """A new push set (engines joined or left the run): the current group is given up
        (`disconnect`: an engine that left cannot take part in tearing it down) and the next
        `connect()` makes one with these; the clients of engines no longer in it are closed."""
        if not engines:
            raise ValueError("engines is empty")
        self.disconnect()
        kept = {id(c) for c in engines}
        gone = [c for c in self._clients if id(c) not in kept]
        self._clients = list(engines)
        await asyncio.gather(*(c.aclose() for c in gone), return_exceptions=True)

    async def close(self) -> None:
        if self._group is not None:
            await self._destroy_on_engines([self.group_name])
            destroy_weight_group(self._group)
            self._group = None
        await asyncio.gather(*(c.aclose() for c in self._clients))


def _in_daemon_thread(
    fn: Callable[[], Any], *, ended: threading.Event | None = None
) -> asyncio.Future[Any]:
    """Run a blocking collective off the event loop. Unlike `asyncio.to_thread`, a daemon
    thread stuck in a dead collective does not block interpreter exit. `ended` is set once
    `fn` has returned or raised, even after the caller gave up on the future."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            value, exc = fn(), None
        except BaseException as e:
            value, exc = None, e
        if ended is not None:
            ended.set()
        # The loop may be gone: an aborted collective can fail after the caller gave up.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, fut, value, exc)
        value = exc = None  # the error's traceback keeps this frame: no cycle through it

    threading.Thread(target=run, name="weight-collective", daemon=True).start()
    return fut


def _keep_forever(obj: Any) -> None:
    """One more reference that is never dropped: `obj` is never destroyed, not even at exit."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _observe(fut: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of a future given up on, so asyncio does not report it."""
    if not fut.cancelled():
        fut.exception()


def _settle(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
