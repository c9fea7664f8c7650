"""Process-group helpers: one process, or `torchrun` ranks (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


def init_distributed(device_name: str = "auto") -> DistInfo:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1), else run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def close_distributed() -> None:
    """Destroy every process group, on a clean exit only. A gloo group left to the interpreter's
    teardown can abort the process ("terminate called without an active exception",
    pytorch#190489); after a failure it is skipped, since destroying a group while peers still
    run collectives can hang (torchtitan does the same)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    if not info.distributed or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    if info.device.type == "cuda":
        t = t.to(info.device)
    dist.all_reduce(t)
    return dict(zip(keys, t.cpu().tolist(), strict=True))


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's object on every rank (the loop reads the bus on rank 0 only)."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(
        box, src=0, device=info.device if info.device.type == "cuda" else None
    )
    return box[0]


def all_gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    if not info.distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out
