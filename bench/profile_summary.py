"""Whether a profiled pass kept the GPU busy, and what made the host wait.

The operator table of `torch.profiler` says which kernels take the GPU's time; it cannot say
whether the GPU sat idle between them. A pass whose host launches kernels more slowly than the
GPU runs them, or that waits on the GPU (a device-to-host read, a copy from pageable memory)
inside its loop, shows as a busy fraction well under 1. This module reduces one profile to:

- `wall_s`: the profiled pass's wall time (measured by the caller around a synchronized
  run), and `plain_s` the same pass's without the profiler, whose own per-operator cost
  slows a host-bound pass;
- `busy_s`, `busy_frac`, `busy_frac_plain`: the union of the device's kernel, copy and set
  intervals, and its share of each wall time (the device's work is the same with or
  without the profiler, so `busy_frac_plain` is the closer estimate of a real run's);
- `launches`: kernel launches the host made (the runtime's launch calls);
- `syncs`, `sync_wait_s`: runtime calls that block the host until the device catches up
  (stream, device and event synchronizations, synchronous copies) and the host time in them;
- `pageable_copies`: copies from or to pageable host memory, which the driver may
  stage through a synchronization of their own (CUDA runtime API, "API synchronization
  behavior");
- `mallocs`: device allocations and frees the caching allocator made (`cudaMalloc`,
  `cudaFree`): in steady state there are none; a pass that makes them, or whose caller counts
  allocator retries (`num_alloc_retries`, the allocator freeing its whole cache and trying
  again under memory pressure), waits on the device there.

Pure functions over the profiler's events (`name`, `device_type`, `time_range` in
microseconds), so they are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch.autograd import DeviceType

# Runtime and driver calls after which the host has waited for the device.
BLOCKING_CALLS = frozenset(
    {
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cuStreamSynchronize",
        "cuCtxSynchronize",
        "cuEventSynchronize",
    }
)
ALLOCATOR_CALLS = frozenset({"cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync"})
LAUNCH_CALLS = frozenset(
    {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
)


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of `[start, end)` intervals (overlapping kernels count once)."""
    total = 0.0
    end_so_far = float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def summarize(events: Sequence[Any], wall_s: float, plain_s: float) -> dict[str, float]:
    """One pass's profile (`prof.events()`) reduced to the numbers of the module docstring."""
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    busy_s = union_us((e.time_range.start, e.time_range.end) for e in device) / 1e6
    blocking = [e for e in host if e.name in BLOCKING_CALLS]
    return {
        "wall_s": round(wall_s, 4),
        "plain_s": round(plain_s, 4),
        "busy_s": round(busy_s, 4),
        "busy_frac": round(busy_s / wall_s, 3) if wall_s > 0 else 0.0,
        "busy_frac_plain": round(busy_s / plain_s, 3) if plain_s > 0 else 0.0,
        "launches": float(sum(e.name in LAUNCH_CALLS for e in host)),
        "syncs": float(len(blocking)),
        "sync_wait_s": round(sum(e.time_range.elapsed_us() for e in blocking) / 1e6, 4),
        "pageable_copies": float(sum("Pageable" in e.name for e in device)),
        "mallocs": float(sum(e.name in ALLOCATOR_CALLS for e in host)),
    }
