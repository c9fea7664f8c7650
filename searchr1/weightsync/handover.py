"""Weights handed over in memory (`/update_weights_from_tensor`): for an engine on the same host
(CPU) or the same GPU (colocated placement) as the trainer.

SGLang's body carries `serialized_named_tensors`: one pickle per TP rank of `[(name, tensor)]`,
whose tensors travel as handles (CUDA IPC on GPU, shared memory on CPU). Our engine never
unpickles what arrives over the network, so it takes a described format instead,
`load_format="searchr1_handles"`: each element of `serialized_named_tensors` is a JSON text
(`Handover`) naming ONE buffer and where each tensor lies in it:
  - CPU: a POSIX shared-memory segment (`multiprocessing.shared_memory`) that the sender created
    and filled; the engine maps it by name (only names this module makes, under /dev/shm: Linux),
    copies out, unmaps;
  - CUDA: the buffer's CUDA IPC handle as plain values (the fields `reduce_tensor` would pickle);
    the engine rebuilds the buffer with `torch.multiprocessing.reductions.rebuild_cuda_tensor`
    from those values and copies out, on the device.
One buffer per bucket: opening an IPC handle costs far more than a view into it.

`HandoverSender` is the trainer side: pause, open a session (SGLang 0.5.21 refuses tensor updates
outside one), one `/update_weights_from_tensor` per bucket (the last carries the new version and
the cache flush), close the session, continue (`session.update_session`, as the broadcast does).
`handover_receiver.HandoverReceiver` is our engine's side. For SGLang (`format="sglang"`) it
sends SGLang's own pickled format instead (SGLang unpickles it: its behaviour, on its
token-protected route). With a `baseline.Baseline`, our engines get delta updates: the buffer
holds each tensor's encoded payload (`Handover.delta` names the encodings) and the engine
decodes into its weights.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import mmap
import os
import re
import secrets
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing import shared_memory
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from searchr1.weightsync.baseline import Baseline, Update, delta_capable, log_resync
from searchr1.weightsync.group import dtype_from_name, dtype_name
from searchr1.weightsync.protocol import DTYPE_NAMES, DeltaHeader, EngineRefused, SessionEngine
from searchr1.weightsync.session import PushStats, update_session, with_last

log = logging.getLogger(__name__)

LOAD_FORMAT = "searchr1_handles"
# Only segments this module creates may be opened by an engine: a name from the network never
# reaches the file system beyond /dev/shm/<this pattern>.
SEGMENT_PREFIX = "searchr1_ho_"
SEGMENT_NAME = re.compile(rf"^{SEGMENT_PREFIX}[0-9a-f]{{16}}$")
SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared memory (shm_open)
ALIGN = 64  # every tensor starts on a 64-byte boundary (any dtype's alignment)
MAX_TENSORS = 1 << 20
MAX_NDIM = 8


class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=1024)
    dtype: Literal[DTYPE_NAMES]  # type: ignore[valid-type]
    shape: list[Annotated[int, Field(ge=0, le=1 << 40)]] = Field(max_length=MAX_NDIM)
    offset: int = Field(ge=0, le=1 << 48)


class ShmBuffer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["shm"] = "shm"
    name: str = Field(pattern=SEGMENT_NAME.pattern)
    size: int = Field(ge=0, le=1 << 48)


class CudaIpcBuffer(BaseModel):
    """The arguments of `rebuild_cuda_tensor` for a flat uint8 buffer, as plain values."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["cuda_ipc"] = "cuda_ipc"
    size: int = Field(ge=0, le=1 << 48)
    device: int = Field(ge=0, le=1024)  # the sender's index; the uuid below wins if known here
    device_uuid: str | None = Field(default=None, max_length=64)
    handle: str = Field(max_length=4096)  # base64 of the cudaIpcMemHandle bytes
    storage_size_bytes: int = Field(ge=0)
    storage_offset_bytes: int = Field(ge=0)
    ref_counter_handle: str = Field(max_length=4096)  # base64
    ref_counter_offset: int = Field(ge=0)
    event_handle: str = Field(max_length=4096)  # base64
    event_sync_required: bool


class Handover(BaseModel):
    """One element of `serialized_named_tensors` under `load_format="searchr1_handles"`."""

    model_config = ConfigDict(extra="forbid")
    buffer: ShmBuffer | CudaIpcBuffer = Field(discriminator="kind")
    tensors: list[TensorSpec] = Field(max_length=MAX_TENSORS)
    # Set: each tensor's bytes are its encoded payload (`delta.nbytes[i]` at its offset).
    delta: DeltaHeader | None = None

    def extents(self) -> list[int]:
        """The bytes each tensor takes in the buffer."""
        if self.delta is not None:
            if len(self.delta.nbytes) != len(self.tensors):
                raise ValueError("delta: one encoding per tensor needed")
            return list(self.delta.nbytes)
        return [_numel(t.shape) * dtype_from_name(t.dtype).itemsize for t in self.tensors]

    def check_bounds(self) -> None:
        """ValueError when a tensor lies outside the buffer."""
        for t, nbytes in zip(self.tensors, self.extents(), strict=True):
            if t.offset + nbytes > self.buffer.size:
                raise ValueError(
                    f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + nbytes}) outside the "
                    f"buffer of {self.buffer.size} bytes"
                )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---- the receiving side (our engine) ---------------------------------------------------------


@contextmanager
def opened(handover: Handover) -> Iterator[dict[str, torch.Tensor]]:
    """The described tensors (with `delta`: their payloads, uint8), as views into the sender's
    buffer, valid inside the block only (copy them out). ValueError: the buffer is not there or
    too small, or a tensor lies outside it."""
    handover.check_bounds()
    buf = handover.buffer
    if isinstance(buf, ShmBuffer):
        # Mapped from /dev/shm directly, not through `SharedMemory`, whose resource tracker
        # would take the segment for ours (and unlink it at our exit): it is the sender's.
        try:
            fd = os.open(SHM_DIR / buf.name, os.O_RDONLY)
        except FileNotFoundError:
            raise ValueError(f"shared-memory segment {buf.name!r} does not exist") from None
        try:
            size = os.fstat(fd).st_size
            if size < buf.size:
                raise ValueError(f"segment {buf.name!r}: {size} bytes, {buf.size} declared")
            # Private and writable (copy-on-write; nothing writes): torch wants a writable buffer.
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            mapped = mmap.mmap(fd, max(buf.size, 1), flags=mmap.MAP_PRIVATE, prot=prot)
        finally:
            os.close(fd)
        try:
            flat = torch.frombuffer(mapped, dtype=torch.uint8, count=max(buf.size, 1))
            views = _views(flat, handover)
            try:
                yield views
            finally:
                del views, flat  # no view may outlive the mapping
        finally:
            mapped.close()
    else:
        flat = _rebuild_cuda(buf)
        try:
            yield _views(flat, handover)
        finally:
            # The copies out are queued on the stream: finished before the sender, told we
            # are done by our answer, frees or reuses its buffer.
            torch.cuda.synchronize(flat.device)


def _views(flat: torch.Tensor, handover: Handover) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for t, nbytes in zip(handover.tensors, handover.extents(), strict=True):
        view = flat[t.offset : t.offset + nbytes]
        out[t.name] = view if handover.delta else view.view(dtype_from_name(t.dtype)).view(t.shape)
    return out


def _rebuild_cuda(buf: CudaIpcBuffer) -> torch.Tensor:
    """The sender's CUDA buffer, opened from its IPC handle (what unpickling `reduce_tensor`'s
    output would call, here from validated plain values)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise ValueError("a cuda_ipc buffer was sent to an engine without CUDA")
    if buf.size > buf.storage_size_bytes:
        raise ValueError(
            f"cuda_ipc buffer: size {buf.size} > storage_size_bytes {buf.storage_size_bytes}"
        )
    device = buf.device
    if buf.device_uuid is not None:  # CUDA_VISIBLE_DEVICES may number the GPU differently here
        uuids = [
            str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
        ]
        if buf.device_uuid not in uuids:
            raise ValueError(f"cuda_ipc buffer: GPU {buf.device_uuid} is not visible to the engine")
        device = uuids.index(buf.device_uuid)
    try:
        handle = base64.b64decode(buf.handle, validate=True)
        ref_handle = base64.b64decode(buf.ref_counter_handle, validate=True)
        event = base64.b64decode(buf.event_handle, validate=True)
    except ValueError as e:
        raise ValueError(f"cuda_ipc buffer: bad base64 ({e})") from None
    # TypedStorage: the storage class `reduce_tensor` records for a plain tensor.
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, (buf.size,), (1,), 0, torch.storage.TypedStorage, torch.uint8,
            device, handle, buf.storage_size_bytes, buf.storage_offset_bytes, False,
            ref_handle, buf.ref_counter_offset, event, buf.event_sync_required,
        )  # fmt: skip
    except RuntimeError as e:  # a stale or made-up handle: the sender's fault, a 400
        raise ValueError(f"cuda_ipc buffer: cannot open the IPC handle ({e})") from None


# ---- the sending side (the trainer) ----------------------------------------------------------


class Packed:
    """One bucket laid out in one buffer, with its JSON description; `close()` frees it (after
    the engine answered: it copies out during the call). With `delta`, the buffer holds each
    tensor's encoded payload (`payloads`) instead of its bytes."""

    def __init__(
        self,
        bucket: list[tuple[str, torch.Tensor]],
        device: torch.device,
        *,
        payloads: list[torch.Tensor] | None = None,
        delta: DeltaHeader | None = None,
    ) -> None:
        if payloads is None:
            payloads = [t.detach().reshape(-1).view(torch.uint8) for _, t in bucket]
        specs, offset = [], 0
        for (name, t), data in zip(bucket, payloads, strict=True):
            specs.append(
                TensorSpec(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape), offset=offset)
            )
            offset += -(-data.numel() // ALIGN) * ALIGN
        self.nbytes = sum(p.numel() for p in payloads)
        self._shm: shared_memory.SharedMemory | None = None
        self._flat: torch.Tensor | None = None  # the CUDA buffer
        if device.type == "cuda":
            self._flat = torch.empty(max(offset, 1), dtype=torch.uint8, device=device)
            flat: torch.Tensor = self._flat
        else:
            name = f"{SEGMENT_PREFIX}{secrets.token_hex(8)}"
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=max(offset, 1))
            flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=max(offset, 1))
        for data, spec in zip(payloads, specs, strict=True):
            flat[spec.offset : spec.offset + data.numel()].copy_(data)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # written before the engine reads
            buffer: ShmBuffer | CudaIpcBuffer = _cuda_buffer(self._flat, offset)
        else:
            del flat
            assert self._shm is not None
            buffer = ShmBuffer(name=self._shm.name, size=offset)
        self.handover = Handover(buffer=buffer, tensors=specs, delta=delta)

    def describe(self) -> str:
        return self.handover.model_dump_json()

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None
        if self._flat is not None:
            self._flat = None
            # Blocks shared over IPC are freed only once their consumers let go: collect now.
            torch.cuda.ipc_collect()


def _cuda_buffer(flat: torch.Tensor, size: int) -> CudaIpcBuffer:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(flat)
    assert args[3] == 0, "a fresh buffer starts its storage"
    # (cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size_bytes,
    #  storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset,
    #  event_handle, event_sync_required): torch's own layout of a shared CUDA tensor.
    uuid = str(torch.cuda.get_device_properties(args[6]).uuid)
    return CudaIpcBuffer(
        size=size, device=args[6], device_uuid=uuid, handle=_b64(args[7]),
        storage_size_bytes=args[8],
        storage_offset_bytes=args[9], ref_counter_handle=_b64(args[11]),
        ref_counter_offset=args[12], event_handle=_b64(args[13]), event_sync_required=args[14],
    )  # fmt: skip


def sglang_serialized(bucket: list[tuple[str, torch.Tensor]], tp_size: int = 1) -> list[str]:
    """SGLang's own format (its `MultiprocessingSerializer.serialize(.., output_str=True)`):
    a ForkingPickler pickle of `[(name, tensor)]`, base64, one per TP rank. For SGLang only:
    our engine refuses it. Each rank gets its own pickle: a CUDA handle's reference count is per
    pickle, and a rank opening another's copy breaks it (SGLang's `deserialize_own_rank`). With
    TP > 1 on GPU every rank then maps this process's GPU memory; slime instead gathers each
    rank's handle from the trainer rank on that rank's GPU (the colocated launcher's job)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    # CPU tensors as named shared-memory files (torch_shm_manager), which any process on the
    # host can open; the default (file descriptors) needs the multiprocessing authkey that an
    # unrelated server does not share. CUDA tensors are IPC handles either way.
    strategy = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        pickles = []
        for _ in range(tp_size):
            out = io.BytesIO()
            ForkingPickler(out).dump(list(bucket))
            pickles.append(_b64(out.getvalue()))
    finally:
        tmp.set_sharing_strategy(strategy)
    return pickles


class TensorEngine(SessionEngine, Protocol):
    """The engine calls a `HandoverSender` drives (`engine_client.client.InferenceClient`)."""

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> None: ...


class HandoverSender:
    """Hands weights to engines on this host/GPU through `/update_weights_from_tensor`.

    `format`: "searchr1" (our engine: described shared memory / CUDA IPC) or "sglang" (SGLang's
    pickled handles). `device`: where the handed-over buffer lives (the engine's device).
    `dtype`: floating tensors are cast to it (default: the engine's, when it reports one)."""

    def __init__(
        self,
        engines: Sequence[TensorEngine],
        *,
        format: Literal["searchr1", "sglang"] = "searchr1",
        device: str | torch.device = "cpu",
        bucket_bytes: int = 512 << 20,
        pause_mode: str | None = "retract",
        dtype: torch.dtype | None = None,
        tp_size: int = 1,
        baseline: Baseline | None = None,
    ) -> None:
        """`baseline`: delta updates to our engines (format searchr1), encoded against it."""
        if not engines:
            raise ValueError("engines is empty")
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be > 0")
        if format not in ("searchr1", "sglang"):
            raise ValueError(f"format must be searchr1 or sglang (got {format!r})")
        self.baseline = baseline if format == "searchr1" else None
        self.engines = list(engines)
        self.format = format
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.dtype = dtype
        self.tp_size = tp_size

    def _buckets(
        self, named: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in named:
            t = t.detach()
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            t = t.to(self.device).contiguous()
            n = t.numel() * t.element_size()
            if bucket and size + n > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += n
        if bucket:
            yield bucket

    async def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        flush_cache: bool = True,
    ) -> PushStats:
        """Hand every tensor to every engine; the engines serve `version` afterwards (default:
        one more than the highest they report), as with the distributed push. With a
        baseline: a delta where every engine holds it, else full; a refused delta is resent in
        full at once."""
        infos: list[dict[str, Any]] = []
        if version is None or self.dtype is None or self.baseline is not None:
            infos = list(await asyncio.gather(*(c.get_model_info() for c in self.engines)))
            if version is None:
                version = max(int(i["weight_version"]) for i in infos) + 1
            if self.dtype is None and infos[0].get("dtype"):  # ours says; SGLang casts itself
                self.dtype = dtype_from_name(infos[0]["dtype"])
        if self.baseline is None or not delta_capable(infos):
            return await self._push(named_tensors, version, flush_cache, None)
        named = list(named_tensors)
        delta = self.baseline.usable([int(i["weight_version"]) for i in infos])
        try:
            update = self.baseline.begin(version, delta=delta)
            return await self._push(named, version, flush_cache, update)
        except EngineRefused as e:
            if not delta:
                raise
            log_resync(e, [c.base_url for c in self.engines])
        update = self.baseline.begin(version, delta=False)
        return await self._push(named, version, flush_cache, update)

    async def _push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        flush_cache: bool,
        update: Update | None,
    ) -> PushStats:
        async with update_session(self.engines, self.pause_mode) as timing:
            total = await self._send(named_tensors, version, flush_cache, update)
        seconds = timing.seconds
        if update is not None:
            update.commit()
        stats = PushStats(
            total,
            seconds,
            version,
            timing.paused_seconds,
            raw_bytes=update.raw_bytes if update else None,
            delta=bool(update and update.delta),
        )
        log.info(
            "weights handed over",
            extra={
                "bytes": total,
                "seconds": round(seconds, 3),
                "version": version,
                "delta": stats.delta,
            },
        )
        return stats

    def _encode(self, bucket: list[tuple[str, torch.Tensor]], update: Update, last: bool) -> Packed:
        """A bucket's payloads against the baseline, packed (worker thread)."""
        held, encodings, payloads = [], [], []
        for name, t in bucket:
            copy, encoding, payload = update.encode(name, t, self.dtype)
            held.append((name, copy))
            encodings.append(encoding)
            payloads.append(payload)
        header = update.header(encodings, [p.numel() for p in payloads], last=last)
        return Packed(held, self.device, payloads=payloads, delta=header)

    async def _send(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int,
        flush_cache: bool,
        update: Update | None = None,
    ) -> int:
        total = 0
        # Delta: buckets as given (encoding casts), so the trainer's tensors are copied once.
        buckets = _by_size(named, self.bucket_bytes) if update else self._buckets(named)
        for bucket, last in with_last(buckets):
            if self.format == "sglang":
                payload, load_format, packed = sglang_serialized(bucket, self.tp_size), None, None
            else:
                if update is None:
                    packed = Packed(bucket, self.device)
                else:
                    packed = await asyncio.to_thread(self._encode, bucket, update, last)
                payload, load_format = [packed.describe()] * self.tp_size, LOAD_FORMAT
            try:
                results = await asyncio.gather(
                    *(
                        c.update_weights_from_tensor(
                            payload,
                            load_format=load_format,
                            flush_cache=flush_cache and last,
                            weight_version=str(version) if last else None,
                        )
                        for c in self.engines
                    ),
                    return_exceptions=True,
                )
            finally:
                if packed is not None:  # every engine has answered: it copied out
                    packed.close()
            total += packed.nbytes if packed is not None else _nbytes(bucket)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        return total


def _nbytes(bucket: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def _by_size(
    named: Iterable[tuple[str, torch.Tensor]], limit: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if bucket and size + n > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket
