"""Weights in and out of a (TP, PP)-sharded `GPTModel`.

In: every rank converts the Hugging Face state dict to the full Megatron layout and copies its
own shards. Out (`gather_hf`): one tensor at a time, the owning stage all-gathers the TP shards,
its first rank sends the full tensor to global rank 0, which converts it to Hugging Face names
and layouts; memory stays at one full tensor, not the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from trainer.backends.megatron import convert
from trainer.backends.megatron.model import ModelShape
from trainer.backends.megatron.parallel import Layout


def layer_offset(shape: ModelShape, layout: Layout) -> int:
    return layout.pp_rank * (shape.num_layers // layout.pp)


@torch.no_grad()
def load_full(
    model: nn.Module, full: dict[str, torch.Tensor], shape: ModelShape, layout: Layout
) -> None:
    """Copy this rank's shards of the full Megatron state dict into `model`."""
    offset = layer_offset(shape, layout)
    for name, param in model.named_parameters():
        src = convert.shard(
            convert.full_name(name, offset, shape),
            full[convert.full_name(name, offset, shape)],
            layout.tp_rank,
            layout.tp,
        )
        if src.shape != param.shape:
            raise ValueError(f"{name}: shard {tuple(src.shape)} != parameter {tuple(param.shape)}")
        param.copy_(src)


def _gather_tp(name: str, t: torch.Tensor, layout: Layout) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if layout.tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(layout.tp)]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return convert.unshard(name, parts)


def _pp_ranks() -> list[int]:
    from megatron.core import parallel_state as ps

    return dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())


def _full_items(model: nn.Module, shape: ModelShape, layout: Layout) -> list[tuple[str, str]]:
    offset = layer_offset(shape, layout)
    out = []
    for name, _ in model.named_parameters():
        full = convert.full_name(name, offset, shape)
        # A tied embedding lives on the first and the last stage: send it from the first only.
        if name == "output_layer.weight" and shape.tied:
            continue
        out.append((name, full))
    return out


@torch.no_grad()
def gather_full(
    model: nn.Module,
    shape: ModelShape,
    layout: Layout,
    value: Callable[[str, nn.Parameter], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full Megatron (name, tensor) pairs, on global rank 0 only (collective on all ranks).

    Only data-parallel rank 0 and its pipeline take part in the sends; the parameters are
    identical on every DP rank (the distributed optimizer all-gathers them after a step).
    `value(local_name, param)` gives another per-parameter tensor of the parameter's shape
    instead (an optimizer moment; it may be collective over DP: every rank calls it)."""
    params = dict(model.named_parameters())
    mine = _full_items(model, shape, layout)
    # Every stage's names, in stage order, on every rank: the order of the sends.
    from megatron.core import parallel_state as ps

    per_stage: list[list[tuple[str, str]]] = [[] for _ in range(layout.pp)]
    if layout.pp > 1:
        dist.all_gather_object(per_stage, mine, group=ps.get_pipeline_model_parallel_group())
    else:
        per_stage = [mine]
    pp_ranks = _pp_ranks()
    me = dist.get_rank()
    dev = next(model.parameters()).device  # NCCL sends device tensors, gloo CPU ones
    for stage, items in enumerate(per_stage):
        for local, full in items:
            if stage == layout.pp_rank:
                p = params[local]
                t = _gather_tp(full, value(local, p) if value else p.detach(), layout)
            if layout.dp_rank != 0 or layout.tp_rank != 0:
                continue
            src = pp_ranks[stage]
            if stage == layout.pp_rank and me == 0:
                # A copy: the caller may keep it while training mutates the parameter.
                yield full, t.detach().float().cpu().clone()
            elif stage == layout.pp_rank:
                meta = [t.dim(), *t.shape, *[0] * (4 - t.dim())]
                dist.send(torch.tensor(meta, dtype=torch.long, device=dev), dst=pp_ranks[0])
                dist.send(t.float().contiguous(), dst=pp_ranks[0])
            elif me == pp_ranks[0]:
                meta = torch.empty(5, dtype=torch.long, device=dev)
                dist.recv(meta, src=src)
                dims = meta[1 : 1 + int(meta[0])].tolist()
                buf = torch.empty(*dims, dtype=torch.float32, device=dev)
                dist.recv(buf, src=src)
                yield full, buf.cpu()


def gather_hf(
    model: nn.Module, shape: ModelShape, layout: Layout
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors with Hugging Face names and layouts, on global rank 0 (collective)."""
    for name, t in gather_full(model, shape, layout):
        yield from convert.to_hf_items(name, t, shape)
