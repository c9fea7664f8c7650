"""Old weight groups are freed on reconnect: the trainer names each connection's group afresh
(`<base>-<hex>`), so an engine that kept every group it joined piled them up (sockets, NCCL
communicators and GPU memory), one per trainer restart or admin call."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from searchr1.weightsync import receiver
from searchr1.weightsync.protocol import GroupJoin
from searchr1.weightsync.receiver import WeightLoader

ARGS: dict[str, Any] = dict(master_address="h", master_port=1, rank_offset=1, world_size=2)


@pytest.fixture
def joined(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    destroyed: list[str] = []
    monkeypatch.setattr(receiver, "new_weight_group", lambda **kw: f"pg:{kw['group_name']}")
    monkeypatch.setattr(receiver, "destroy_weight_group", destroyed.append)
    return destroyed


def test_a_new_group_frees_the_previous_one(joined: list[str]) -> None:
    loader = WeightLoader(torch.nn.Linear(2, 2))
    loader.init_group(GroupJoin(**ARGS, group_name="w-aaaa", backend="gloo"))
    loader.init_group(GroupJoin(**ARGS, group_name="w-bbbb", backend="gloo"))
    assert list(loader.groups) == ["w-bbbb"]
    assert joined == ["pg:w-aaaa"]


def test_a_failed_join_keeps_the_working_group(
    joined: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = WeightLoader(torch.nn.Linear(2, 2))
    loader.init_group(GroupJoin(**ARGS, group_name="w-aaaa", backend="gloo"))

    def unreachable(**kw: Any) -> Any:
        raise TimeoutError("rendezvous timed out")

    monkeypatch.setattr(receiver, "new_weight_group", unreachable)
    with pytest.raises(TimeoutError):
        loader.init_group(GroupJoin(**ARGS, group_name="w-bbbb", backend="gloo"))
    assert list(loader.groups) == ["w-aaaa"] and joined == []
