"""bench/trainer.py's process-group hand-over: the push part's raw broadcast after a training
backend (Megatron) left its default group up, and no receiver child outliving a failure."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from bench.trainer import raw_broadcast_seconds, teardown_process_groups
from searchr1.redis_server import free_port


@pytest.fixture
def leftover_group() -> Iterator[None]:
    """A one-rank gloo group, as the Megatron backend leaves it after its bench part (one an
    earlier in-process test left up serves as well)."""
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_raw_broadcast_after_teardown(leftover_group: None) -> None:
    teardown_process_groups()
    assert not dist.is_initialized()
    assert raw_broadcast_seconds(1024) > 0
    assert not dist.is_initialized()
    assert mp.active_children() == []


def test_a_failed_raw_broadcast_leaves_no_receiver_behind(leftover_group: None) -> None:
    # The parent cannot join a second default group: the receiver child, already waiting in
    # its rendezvous, must be killed rather than joined at exit (it would wait forever).
    with pytest.raises(ValueError, match="twice"):
        raw_broadcast_seconds(1024, timeout_s=30)
    assert mp.active_children() == []
