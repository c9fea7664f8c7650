"""Distributed checkpoints of the Megatron backend: every rank writes and reads its own shards.

What is saved: for every tensor of the full Megatron model (global layer indices, the
vocabulary cut to its real size, so the key set and shapes name no layout), its fp32 value
(`param/<name>`) and Adam's two moments (`exp_avg/<name>`, `exp_avg_sq/<name>`), as blocks of
`trainer.shards`. Each rank writes what it owns: with the distributed optimizer, the DP range
of its TP shard of its stage's parameters (the fp32 main parameters and their moments); TP
replicas (norms) and the tied embedding's copy on the last stage are written once. Nothing is
gathered and no rank holds more than its own shard.

Loading: every rank computes the rectangles its own layout needs (its whole TP shard of each
weight, its DP range of the optimizer state) and reads them from whichever files hold them, so
a checkpoint written at one (TP, PP, DP) layout loads at any other. The step counters and the
LR schedule position are small; the main rank keeps them with the trainer's state and
broadcasts them as JSON.

A DP range of a flattened `rows x cols` shard is at most three rectangles (a partial first
row, whole rows, a partial last row); each maps to the full tensor through the TP split of
`convert` (the fc1 gate/up halves are two row segments, row-parallel shards a column offset).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.backends.megatron import convert
from trainer.backends.megatron.checkpoint import BackendState, local_state, owner
from trainer.backends.megatron.model import ModelShape
from trainer.backends.megatron.parallel import Layout
from trainer.backends.megatron.weights import layer_offset
from trainer.shards import Block, ShardReader, write_index, write_rank

KINDS = ("param", "exp_avg", "exp_avg_sq")
_MOMENTS = KINDS[1:]


@dataclass(frozen=True)
class ShardPlacement:
    """Where one rank's shard (its 2-D view, `rows x cols`) sits in the full tensor `key`."""

    key: str
    shape: tuple[int, int]  # the full tensor's 2-D view (vocabulary rows cut)
    cols: int  # the shard's columns
    col: int  # its first column in the full tensor (row-parallel TP shards)
    segments: tuple[tuple[int, int, int], ...]  # (local row start, end, full row start)
    replicated: bool  # the same on every TP rank


def placement(
    local: str, param_shape: tuple[int, ...], shape: ModelShape, layout: Layout
) -> ShardPlacement:
    key = convert.full_name(local, layer_offset(shape, layout), shape)
    rows = param_shape[0]
    cols = 1
    for n in param_shape[1:]:
        cols *= n
    tp, r = layout.tp, layout.tp_rank
    split = convert.tp_split(key)
    full, col, full_cols = rows, 0, cols
    segments: tuple[tuple[int, int, int], ...] = ((0, rows, 0),)
    if split == "fc1":
        half = rows // 2
        full = rows * tp
        segments = ((0, half, r * half), (half, rows, tp * half + r * half))
    elif split == "column":
        full = rows * tp
        segments = ((0, rows, r * rows),)
        if convert.is_vocab(key):
            full = shape.vocab_size
            real = max(0, min(rows, full - r * rows))  # the rest is padding: not saved
            segments = ((0, real, r * rows),) if real else ()
    elif split == "row":
        full_cols, col = cols * tp, r * cols
    return ShardPlacement(key, (full, full_cols), cols, col, segments, split == "none")


def blocks(p: ShardPlacement, start: int, end: int) -> list[tuple[Block, int]]:
    """The full-tensor rectangles of the range `[start, end)` of the flattened shard, each
    with its offset in that range (its elements are contiguous there)."""
    local: list[tuple[int, int, int, int]] = []  # (row, rows, col, cols) in the shard
    s, c = start, p.cols
    row, col = divmod(s, c)
    if col and s < end:
        n = min(c - col, end - s)
        local.append((row, 1, col, n))
        s, row = s + n, row + 1
    if (end - s) // c:
        local.append((row, (end - s) // c, 0, c))
        row, s = row + (end - s) // c, s + (end - s) // c * c
    if s < end:
        local.append((row, 1, 0, end - s))
    out = []
    for row, rows, col, cols in local:
        for lo, hi, full in p.segments:
            a, b = max(row, lo), min(row + rows, hi)
            if a < b:
                block = Block(p.key, full + a - lo, p.col + col, b - a, cols)
                out.append((block, a * c + col - start))
    return out


def _broadcast_json(obj: Any, device: torch.device) -> Any:
    """`obj` (JSON) from global rank 0 to every rank: bytes in a tensor, no pickle."""
    data = json.dumps(obj).encode() if dist.get_rank() == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.long, device=device)
    dist.broadcast(n, src=0)
    buf = torch.zeros(int(n), dtype=torch.uint8, device=device)
    if data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def _mine(backend: BackendState, name: str, p: ShardPlacement) -> bool:
    """Whether this rank writes the parameter's blocks (one copy of each element)."""
    if name == "output_layer.weight" and backend.shape.tied:
        return False  # the first stage writes the embedding
    if p.replicated and backend.layout.tp_rank != 0:
        return False
    return backend.cfg.megatron.distributed_optimizer or backend.layout.dp_rank == 0


@torch.no_grad()
def save_shards(backend: BackendState, directory: Path) -> dict[str, Any]:
    """Collective: every rank writes its own file into `directory`; returns the small
    non-tensor state (the same on every rank). The caller's main rank has prepared the parent
    directory before calling."""
    dist.barrier()
    directory.mkdir(parents=True, exist_ok=True)
    items: list[tuple[Block, torch.Tensor]] = []
    shapes: dict[str, tuple[int, int]] = {}
    s, layout = backend.shape, backend.layout
    for name, param in backend.ddp.module.named_parameters():
        p = placement(name, tuple(param.shape), s, layout)
        if not _mine(backend, name, p):
            continue
        start, end, states = local_state(backend, param)
        for kind in KINDS:
            value = states.get(kind)
            flat = (
                value.detach().float().reshape(-1).cpu()
                if value is not None
                else torch.zeros(end - start)  # Adam before its first step
            )
            for block, off in blocks(p, start, end):
                items.append(
                    (
                        Block(f"{kind}/{block.key}", block.row, block.col, block.rows, block.cols),
                        flat[off : off + block.numel].view(block.rows, block.cols),
                    )
                )
                shapes[f"{kind}/{block.key}"] = p.shape
    error: Exception | None = None
    try:
        write_rank(directory, dist.get_rank(), items, shapes)
    except Exception as e:  # the other ranks must hear of it, not wait at a barrier
        error = e
    failures: list[str | None] = [None] * dist.get_world_size()
    mine = None if error is None else f"rank {dist.get_rank()}: {error}"
    dist.all_gather_object(failures, mine)  # also the barrier: every rank's file is done
    if error is not None:
        raise error
    if any(failures):
        raise OSError(f"a shard was not written: {'; '.join(f for f in failures if f)}")
    if dist.get_rank() == 0:
        write_index(directory, dist.get_world_size(), {"layout": _layout_json(layout)})
    return {"optimizer_steps": backend.optimizer_steps, "train_steps": backend._train_steps}


def _layout_json(layout: Layout) -> dict[str, int]:
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}


def _read(reader: ShardReader, kind: str, p: ShardPlacement, start: int, end: int) -> torch.Tensor:
    """The range `[start, end)` of the flattened shard (vocabulary padding stays 0)."""
    key = f"{kind}/{p.key}"
    if p.segments and reader.shapes.get(key) != p.shape:
        raise ValueError(
            f"{reader.directory}: {key} has shape {reader.shapes.get(key)}, the model "
            f"{p.shape}: a checkpoint of another model"
        )
    out = torch.zeros(end - start)
    for block, off in blocks(p, start, end):
        target = out[off : off + block.numel].view(block.rows, block.cols)
        reader.read(Block(key, block.row, block.col, block.rows, block.cols), target)
    return out


@torch.no_grad()
def load_shards(
    backend: BackendState,
    directory: Path | None,
    state: dict[str, Any] | None,
    *,
    weights_only: bool = False,
) -> None:
    """Inverse of `save_shards` at this backend's layout (collective). `directory` and the
    small `state` are read on global rank 0 and broadcast. `weights_only` (an export) skips
    Adam's moments: two thirds of the bytes, left unread."""
    mine = [str(directory), state] if dist.get_rank() == 0 else None
    box = _broadcast_json(mine, backend.device)
    directory, state = Path(box[0]), box[1]
    if state is None:
        raise ValueError("no checkpoint state on rank 0")
    s, layout, model = backend.shape, backend.layout, backend.ddp.module
    step = int(state["optimizer_steps"])
    with ShardReader(directory) as reader:
        for name, param in model.named_parameters():
            p = placement(name, tuple(param.shape), s, layout)
            weights = _read(reader, "param", p, 0, param.numel())
            param.copy_(weights.view_as(param))
            start, end, states = local_state(backend, param)
            if end == start:
                continue
            main = states["param"]  # fp32 (a view of the parameter itself when that is fp32)
            main.copy_(weights[start:end].view_as(main))
            if weights_only:
                continue
            inner = owner(backend, param).optimizer.state.setdefault(main, {})
            for k in _MOMENTS:
                inner[k] = _read(reader, k, p, start, end).view_as(main).to(main)
            inner["step"] = torch.tensor(float(step))
    backend._train_steps = int(state["train_steps"])
    backend._steps = step
