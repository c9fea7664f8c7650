"""Releasing and resuming the engine's memory (SGLang's `/release_memory_occupation` and
`/resume_memory_occupation`), so a trainer on the same device can use it between rollouts.

Tags, as SGLang 0.5.21 defines them (`sglang.srt.constants`); none or an empty list means all:
  - `kv_cache`: the prefix cache's K/V (and the decode batch's, empty since release needs an idle
    engine) is dropped; resuming it only lets generation run again (the cache refills on use);
  - `weights`: every parameter's storage is freed (replaced by an empty one; the Parameter
    objects stay, so tied weights stay tied; their shapes are kept here). Resuming allocates
    them again with undefined content, as SGLang does with torch_memory_saver: the weights must then
    be reloaded by a weight update (`update_weights_from_tensor`, `..._from_distributed` or
    `..._from_disk`), and until one lands generation answers 503. With `weights_cpu_backup`
    (SGLang's `--enable-weights-cpu-backup`) a CPU copy is kept at release and restored at
    resume instead. Buffers (rotary tables) are small and stay, as SGLang stashes and restores
    them;
  - `cuda_graph`: accepted, nothing to free (this engine captures no CUDA graphs).
After freeing, the allocator gives the memory back: `torch.cuda.empty_cache()` on CUDA,
glibc's `malloc_trim` on CPU.

Every method runs on the scheduler thread (engine commands), so no lock is needed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable, Iterable

import torch
from prometheus_client import Counter, Gauge

log = logging.getLogger(__name__)

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)

RELEASED = Gauge("searchr1_inference_memory_released", "1 while this memory is released", ["tag"])
AWAITING_WEIGHTS = Gauge(
    "searchr1_inference_awaiting_weights",
    "1 while resumed weights have no content yet (generation answers 503 until a weight update)",
)
PARAM_BYTES = Gauge(
    "searchr1_inference_parameter_bytes", "Bytes of parameter storage the engine holds"
)
MEMORY_CALLS = Counter(
    "searchr1_inference_memory_calls_total", "Release/resume calls", ["call", "outcome"]
)
for _tag in ALL_TAGS:
    RELEASED.labels(_tag).set(0)
for _call in ("release", "resume"):  # at 0 from start-up: "no refusals", not "No data"
    for _outcome in ("ok", "rejected"):
        MEMORY_CALLS.labels(_call, _outcome)


class MemoryReleased(Exception):
    """Generation is refused: memory is released or weights await reloading (HTTP 503)."""


def normalize_tags(tags: list[str] | None) -> list[str]:
    """SGLang's rule: none or empty means every tag. ValueError naming `tags` otherwise."""
    if not tags:
        return list(ALL_TAGS)
    unknown = sorted(set(tags) - set(ALL_TAGS))
    if unknown:
        raise ValueError(f"tags: unknown {unknown}; known: {list(ALL_TAGS)}")
    return list(dict.fromkeys(tags))


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter storage resident, each shared storage once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        storage = p.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _give_back(device: torch.device) -> None:
    """Return freed memory to the device/OS (a caching allocator keeps it otherwise)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return
    # Not glibc: the allocator keeps what it keeps.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class MemoryState:
    """What is released, and the freeing/re-allocating of the model's parameters."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        *,
        cpu_backup: bool = False,
        flush_kv: Callable[[], None],
    ) -> None:
        self.model = model
        self.device = device
        self.cpu_backup = cpu_backup
        self._flush_kv = flush_kv
        self.released: set[str] = set()
        self.awaiting_weights = False
        self._backup: dict[int, torch.Tensor] = {}
        self._shapes: dict[int, torch.Size] = {}  # of released parameters, by id
        PARAM_BYTES.set(parameter_bytes(model))

    # ---- state -----------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        return not self.released and not self.awaiting_weights

    def describe(self) -> str:
        if self.released:
            return f"released: {sorted(self.released)}"
        if self.awaiting_weights:
            return "awaiting weights (resumed without content: send a weight update)"
        return "resident"

    def refuse_generation(self) -> None:
        """MemoryReleased unless generation can run."""
        if self.released:
            raise MemoryReleased(
                f"memory released ({sorted(self.released)}): resume_memory_occupation first"
            )
        if self.awaiting_weights:
            raise MemoryReleased(
                "weights were released and resumed without content: send a weight update first"
            )

    def require_weights(self, what: str) -> None:
        """ValueError when the parameters have no storage to load into."""
        if WEIGHTS in self.released:
            raise ValueError(
                f"{what}: the weights are released; resume_memory_occupation(tags=['weights']) "
                "first"
            )

    def weights_loaded(self) -> None:
        """A weight update landed: the resumed weights have content again."""
        self.awaiting_weights = False
        AWAITING_WEIGHTS.set(0)

    def weights_broken(self) -> None:
        """A multi-call update failed midway: the weights are a mix, serve none of them."""
        self.awaiting_weights = True
        AWAITING_WEIGHTS.set(1)

    # ---- release / resume ------------------------------------------------------------------

    def release(
        self,
        tags: list[str] | None,
        *,
        running: int,
        waiting: int,
        paused: bool,
        session_open: bool = False,
    ) -> None:
        try:
            tags = normalize_tags(tags)
            again = sorted(set(tags) & self.released)
            if again:
                raise ValueError(f"tags: {again} already released")
            # A session's end would load into freed storage (SGLang refuses alike).
            if WEIGHTS in tags and session_open:
                raise ValueError(
                    "a weight-update session is open: end_weight_update before releasing weights"
                )
            # SGLang's rule: only an idle engine releases (a paused one may keep a queue).
            if running or (waiting and not paused):
                raise ValueError(
                    f"release_memory_occupation needs an idle engine ({running} running, "
                    f"{waiting} waiting): pause_generation (abort or retract) first"
                )
        except ValueError:
            MEMORY_CALLS.labels("release", "rejected").inc()
            raise
        before = parameter_bytes(self.model)
        if KV_CACHE in tags:
            self._flush_kv()
        if WEIGHTS in tags:
            self._free_weights()
        self.released.update(tags)
        for tag in tags:
            RELEASED.labels(tag).set(1)
        _give_back(self.device)
        after = parameter_bytes(self.model)
        PARAM_BYTES.set(after)
        MEMORY_CALLS.labels("release", "ok").inc()
        log.info(
            "memory released",
            extra={"tags": tags, "parameter_bytes_before": before, "parameter_bytes": after},
        )

    def resume(self, tags: list[str] | None) -> None:
        try:
            tags = normalize_tags(tags)
            missing = sorted(set(tags) - self.released)
            if missing:
                raise ValueError(f"tags: {missing} not released")
        except ValueError:
            MEMORY_CALLS.labels("resume", "rejected").inc()
            raise
        if WEIGHTS in tags:
            self._allocate_weights()
        self.released.difference_update(tags)
        for tag in tags:
            RELEASED.labels(tag).set(0)
        PARAM_BYTES.set(parameter_bytes(self.model))
        MEMORY_CALLS.labels("resume", "ok").inc()
        log.info("memory resumed", extra={"tags": tags, "awaiting_weights": self.awaiting_weights})

    def _unique_params(self) -> Iterable[torch.nn.Parameter]:
        seen: set[int] = set()
        for p in self.model.parameters():  # tied weights: one Parameter under two names
            if id(p) not in seen:
                seen.add(id(p))
                yield p

    @torch.no_grad()
    def _free_weights(self) -> None:
        for p in self._unique_params():
            if self.cpu_backup:  # pinned on CUDA: the copy back at resume is fast
                pin = self.device.type == "cuda"
                backup = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                self._backup[id(p)] = backup.copy_(p.data)
            # Same Parameter object, storage gone: modules and ties keep pointing at it. (Not
            # `meta`: a Parameter cannot change device type; not `storage.resize_(0)`: weights
            # mapped from a safetensors file have a storage that cannot be resized.)
            self._shapes[id(p)] = p.shape
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    @torch.no_grad()
    def _allocate_weights(self) -> None:
        for p in self._unique_params():
            data = torch.empty(self._shapes.pop(id(p)), dtype=p.dtype, device=self.device)
            backup = self._backup.pop(id(p), None)
            if backup is not None:
                data.copy_(backup)
            p.data = data
        self.awaiting_weights = not self.cpu_backup
        AWAITING_WEIGHTS.set(int(self.awaiting_weights))
