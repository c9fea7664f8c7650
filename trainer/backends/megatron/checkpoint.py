"""Full, layout-independent state of the Megatron backend (`TrainerBackend.full_state`).

The trainer's checkpoints of this backend are distributed (`sharded.py`: every rank writes its
own shards); this gathered state is the backend interface's full state (tests compare
backends with it). It is kept in Hugging Face names and layouts: the weights and Adam's two
moments per HF tensor, plus the step counters, so it loads at any (TP, PP, DP) layout.

Gathering: each DP rank of the distributed optimizer holds a contiguous range of every
flattened parameter; the ranges are all-gathered over DP, then the TP shards and PP stages are
gathered as for a weight push (`weights.gather_full`). Loading reverses it: the main rank
broadcasts the state, every rank writes its own shard and range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from trainer.backends.megatron import convert
from trainer.backends.megatron.model import ModelShape
from trainer.backends.megatron.parallel import Layout
from trainer.backends.megatron.weights import gather_full, layer_offset, load_full
from trainer.config import TrainerConfig


class BackendState(Protocol):
    """What this module reads and sets of `trainer.backends.megatron.backend.MegatronBackend`."""

    cfg: TrainerConfig
    rank: int
    device: torch.device
    dp_size: int
    shape: ModelShape
    layout: Layout
    padded_vocab: int
    ddp: Any
    optimizer: Any
    _train_steps: int
    _steps: int

    @property
    def optimizer_steps(self) -> int: ...


_MOMENTS = ("exp_avg", "exp_avg_sq")


def _dp_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def owner(backend: BackendState, param: nn.Parameter) -> Any:
    """The Megatron optimizer holding `param` (get_megatron_optimizer may chain several); None
    where the distributed optimizer gave this DP rank no part of it."""
    for opt in getattr(backend.optimizer, "chained_optimizers", [backend.optimizer]):
        if backend.cfg.megatron.distributed_optimizer:
            if param in opt.model_param_gbuf_map:
                return opt
        elif any(p is param for g in opt.optimizer.param_groups for p in g["params"]):
            return opt
    assert backend.cfg.megatron.distributed_optimizer, "a parameter without an optimizer"
    return None


def local_state(backend: BackendState, param: nn.Parameter) -> tuple[int, int, dict]:
    """(start, end, {"param" and moments}) of this DP rank's range of the flattened `param`."""
    opt = owner(backend, param)
    if opt is None:
        return 0, 0, {}
    if backend.cfg.megatron.distributed_optimizer:
        rng = opt._get_model_param_range_map(param)["param"]
        if rng.size == 0:
            return 0, 0, {}
        return rng.start, rng.end, opt._get_main_param_and_optimizer_states(param)
    return 0, param.numel(), {"param": param, **opt.optimizer.state.get(param, {})}


def _moment(backend: BackendState, key: str) -> Callable[[str, nn.Parameter], torch.Tensor]:
    def value(_name: str, param: nn.Parameter) -> torch.Tensor:
        start, end, states = local_state(backend, param)
        mine = (start, end, states[key].detach().float().cpu() if key in states else None)
        if backend.dp_size > 1:
            parts: list[Any] = [None] * backend.dp_size
            dist.all_gather_object(parts, mine, group=_dp_group())
        else:
            parts = [mine]
        flat = torch.zeros(param.numel())
        for s, e, t in parts:
            if t is not None:
                flat[s:e] = t.view(-1)
        return flat.view(param.shape).to(param.device)

    return value


def _hf(backend: BackendState, value: Any = None) -> dict[str, torch.Tensor]:
    model = backend.ddp.module
    out: dict[str, torch.Tensor] = {}
    for name, t in gather_full(model, backend.shape, backend.layout, value=value):
        out.update(convert.to_hf_items(name, t, backend.shape))
    return out


def full_state(backend: BackendState) -> dict[str, Any]:
    """Complete on global rank 0 (collective)."""
    # The fp32 main parameters where the model's are bf16 (the same values in fp32).
    bf16 = next(backend.ddp.module.parameters()).dtype != torch.float32
    state: dict[str, Any] = {"model": _hf(backend, _moment(backend, "param") if bf16 else None)}
    state["optimizer"] = {k: _hf(backend, _moment(backend, k)) for k in _MOMENTS}
    state["optimizer"]["step"] = backend.optimizer_steps
    state["scheduler"] = {"train_steps": backend._train_steps}
    state["optimizer_steps"] = backend.optimizer_steps
    return state


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@torch.no_grad()
def load_full_state(backend: BackendState, state: dict[str, Any] | None) -> None:
    """Inverse of `full_state`; `state` is read on global rank 0 only (collective)."""
    state = _broadcast(state if backend.rank == 0 else None)
    if state is None:
        raise ValueError("no state to load on rank 0")
    s, layout, model = backend.shape, backend.layout, backend.ddp.module
    weights = convert.hf_to_full(state["model"], s, backend.padded_vocab)
    load_full(model, weights, s, layout)
    moments = {
        k: convert.hf_to_full(state["optimizer"][k], s, backend.padded_vocab) for k in _MOMENTS
    }
    step = int(state["optimizer"]["step"])
    offset = layer_offset(s, layout)
    for name, param in model.named_parameters():
        start, end, states = local_state(backend, param)
        if end == start:
            continue
        full_name = convert.full_name(name, offset, s)
        main = states["param"]  # fp32 (a view of the parameter itself when that is fp32)
        full = convert.shard(full_name, weights[full_name], layout.tp_rank, layout.tp)
        main.copy_(full.reshape(-1)[start:end].view_as(main))
        inner = owner(backend, param).optimizer.state.setdefault(main, {})
        for k in _MOMENTS:
            shard = convert.shard(full_name, moments[k][full_name], layout.tp_rank, layout.tp)
            inner[k] = shard.reshape(-1)[start:end].clone().view_as(main).to(main)
        inner["step"] = torch.tensor(float(step))
    backend._train_steps = int(state["scheduler"]["train_steps"])
    backend._steps = int(state["optimizer_steps"])
