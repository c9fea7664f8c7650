"""Moving what the trainer holds between training steps off its device (colocated placement:
the engines generate on the same GPUs meanwhile), and back before the next step.

`optimizer`: the optimizer's state (Adam's two moments: 2x the parameters in fp32, the largest
part of a trainer's memory); `reference`: the frozen KL reference model, used only inside a
step. Parameters and gradients stay (the next push and step need them at once; slime offloads
them too, at the cost of a reload per step). Works on plain tensors and on FSDP2's DTensors
(`.to` keeps their placement).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> int:
    """Every state tensor of `optimizer` to `device`; returns the bytes moved (0 when already
    there)."""
    moved = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != torch.device(device):
                state[key] = value.to(device, non_blocking=True)
                moved += value.numel() * value.element_size()
    return moved


def move_module(module: nn.Module | None, device: torch.device | str) -> int:
    """`module`'s parameters and buffers to `device`; returns the bytes moved."""
    if module is None:
        return 0
    tensors: Iterable[torch.Tensor] = [*module.parameters(), *module.buffers()]
    moved = sum(t.numel() * t.element_size() for t in tensors if t.device != torch.device(device))
    module.to(device)
    return moved
