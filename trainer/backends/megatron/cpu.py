"""Run Megatron-Core on CPU (fp32, gloo): the few CUDA calls it makes unconditionally.

megatron-core assumes a GPU in a handful of places that matter for a CPU forward/backward:
the current device (used to place new tensors), the CUDA RNG used by its model-parallel RNG
tracker, and the collectives of the distributed optimizer (gloo has no reduce-scatter). These
shims map them to their CPU equivalents. They are installed only when the trainer runs on CPU
(tests, the local demo); the CUDA path never calls `install()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_installed = False


def _reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # type: ignore[no-untyped-def]
    # gloo has no reduce-scatter: all-reduce a copy, keep this rank's slice.
    full = input.clone()
    dist.all_reduce(full, op=op, group=group)
    rank = dist.get_rank(group)
    n = output.numel()
    output.copy_(full.view(-1)[rank * n : (rank + 1) * n].view_as(output))
    return _Done() if async_op else None


class _Done:
    def wait(self) -> bool:
        return True


class _CudaToCpu(TorchFunctionMode):
    """Megatron's schedules, optimizer and grad clipping create small bookkeeping tensors with
    a literal `device="cuda"` (made on the CPU instead here) and check parameter types by
    name (`torch.cuda.FloatTensor`: a CPU tensor answers with the CUDA name here)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and str(dev).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    with _CudaToCpu():
        yield


def install() -> None:
    """Idempotent; call before building a Megatron model on CPU."""
    global _installed
    if _installed:
        return
    _installed = True
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    for mod in (cuda, cuda.random):
        mod.get_rng_state = lambda device=None: torch.get_rng_state()  # type: ignore[attr-defined]
        mod.set_rng_state = lambda state, device=None: torch.set_rng_state(state)  # type: ignore[attr-defined]
        mod.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[attr-defined]
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(
        state
    )
    mp_random._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    if dist.is_available():
        dist.reduce_scatter_tensor = _reduce_scatter_tensor  # type: ignore[assignment]
