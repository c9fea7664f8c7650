"""Offloading between steps (colocated placement): what moves, and that training goes on after
a round trip. CPU only here: the "other device" is torch's meta device (no data), which shows
what is moved and counted; a GPU run moves to and from the GPU."""

from __future__ import annotations

import torch
from torch import nn

from trainer.offload import move_module, move_optimizer_state


def adam_with_state() -> tuple[nn.Linear, torch.optim.AdamW]:
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_state_moves_and_is_counted() -> None:
    _, opt = adam_with_state()
    # exp_avg and exp_avg_sq per parameter (float32); `step` is a CPU scalar tensor too.
    moments = 2 * (4 * 3 + 3) * 4
    moved = move_optimizer_state(opt, "meta")
    assert moved >= moments
    for state in opt.state.values():
        assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].device.type == "meta"
    assert move_optimizer_state(opt, "meta") == 0  # already there


def test_a_round_trip_on_the_same_device_changes_nothing_and_training_goes_on() -> None:
    model, opt = adam_with_state()
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    assert move_optimizer_state(opt, "cpu") == 0
    after = opt.state[model.weight]
    assert all(torch.equal(before[k], after[k]) for k in before)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # still steps


def test_a_module_moves_and_is_counted() -> None:
    ref = nn.Linear(4, 3)
    assert move_module(ref, "meta") == (4 * 3 + 3) * 4
    assert ref.weight.device.type == "meta"
    assert move_module(None, "cpu") == 0
