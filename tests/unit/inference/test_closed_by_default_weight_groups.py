"""Old weight groups are freed on reconnect: the trainer names each connection's group afresh
(`<base>-<hex>`), so an engine that kept every group it joined piled them up (sockets, NCCL
communicators and GPU memory), one per trainer restart or admin call."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from searchr1.weightsync import receiver
from searchr1.weightsync.protocol import GroupJoin
from searchr1.weightsync.receiver import GroupAlreadyFreed, WeightLoader

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


def test_destroying_a_group_the_engine_already_freed_is_told_apart(joined: list[str]) -> None:
    """The trainer frees its old groups after joining a new one (`WeightSender`), but the
    engine freed them at the join already. The answer stays SGLang's "does not exist" (a 400),
    marked as expected (`GroupAlreadyFreed`), so the server does not log a failed admin
    request on every takeover; a name never joined is a plain refusal."""
    loader = WeightLoader(torch.nn.Linear(2, 2))
    loader.init_group(GroupJoin(**ARGS, group_name="w-aaaa", backend="gloo"))
    loader.init_group(GroupJoin(**ARGS, group_name="w-bbbb", backend="gloo"))
    with pytest.raises(GroupAlreadyFreed, match="does not exist"):
        loader.destroy_group("w-aaaa")  # freed when w-bbbb joined
    assert joined == ["pg:w-aaaa"] and list(loader.groups) == ["w-bbbb"]
    with pytest.raises(ValueError, match="does not exist") as never:
        loader.destroy_group("w-never")
    assert not isinstance(never.value, GroupAlreadyFreed)
    loader.destroy_group("w-bbbb")
    assert joined == ["pg:w-aaaa", "pg:w-bbbb"] and loader.groups == {}


def test_the_server_logs_the_expected_refusal_quietly(caplog: pytest.LogCaptureFixture) -> None:
    from inference.server import _fail

    with caplog.at_level(logging.DEBUG, logger="inference.server"):
        quiet = _fail(GroupAlreadyFreed("The group to be destroyed does not exist."))
        loud = _fail(ValueError("The group to be destroyed does not exist."))
    assert quiet.status_code == loud.status_code == 400
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.WARNING]
