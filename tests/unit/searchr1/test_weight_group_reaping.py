"""A weight group given up on after a failed push is destroyed once its collective has ended,
and not before. Each abandoned gloo group holds file descriptors (its pair sockets, its epoll
device, its store connection) and threads; the trainer used to keep every one alive for good,
one more per engine restart or refused push (the soak's trainer fds 29 -> 35 -> 41,
docs/reliability.md, "Soak")."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import searchr1.weightsync.group as group_mod
from searchr1.weightsync.group import (
    abandon_weight_group,
    host_store,
    new_weight_group,
    reap_abandoned_groups,
    store_client,
)
from searchr1.weightsync.sender import WeightSender, _in_daemon_thread

ROOT = Path(__file__).resolve().parents[3]
ADDR = "127.0.0.1"
# The group's: a collective nobody ends fails after it at the latest; also how long rank 0
# waits for rank 1 to join (a fresh interpreter importing torch: over 10 s on a loaded
# 2-core machine). Rank 1 is killed, so nothing here waits for it in full.
TIMEOUT_S = 60.0
# Large enough that the root's send cannot complete into the socket buffers while rank 1 does
# not receive: the broadcast stays in flight until rank 1 dies.
ELEMENTS = 4_000_000

RANK_1 = """
import sys, time
from searchr1.weightsync.group import new_weight_group
new_weight_group(backend="gloo", master_address={addr!r}, master_port={port}, world_size=2,
                 rank=1, group_name={name!r}, timeout_s={timeout})
print("joined", flush=True)
time.sleep(60)  # in the group, never in the broadcast: an engine that refused the bucket
"""


def resources() -> tuple[int, int]:
    """This process's open file descriptors and OS threads (gloo's are C++ threads, which
    `threading` does not see)."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def settled(expected: tuple[int, int], within_s: float = 5.0) -> tuple[int, int]:
    """`resources()` once it equals `expected`, or after `within_s`: the rendezvous server
    closes its side of a connection on its own thread, a moment after the client's side."""
    deadline = time.monotonic() + within_s
    while (now := resources()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


@pytest.fixture
def held() -> Any:
    """The abandoned groups (module state), with only the test's own in it: those other tests
    left are set aside, not reaped, and put back afterwards."""
    before = list(group_mod._ABANDONED)
    group_mod._ABANDONED.clear()
    yield group_mod._ABANDONED
    group_mod._ABANDONED[:0] = before


async def test_an_abandoned_group_is_destroyed_once_its_collective_ends(held: Any) -> None:
    store = host_store(ADDR, 0, TIMEOUT_S)  # the sender's, for its whole life: not counted
    port = int(store.port)
    name = f"reap-{os.getpid()}"
    before = resources()

    rank_1 = subprocess.Popen(
        [
            sys.executable,
            "-c",
            RANK_1.format(addr=ADDR, port=port, name=name, timeout=TIMEOUT_S),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        # Blocking calls on the loop's own thread: asyncio's executor threads would stay.
        group = new_weight_group(
            backend="gloo",
            master_address=ADDR,
            master_port=port,
            world_size=2,
            rank=0,
            group_name=name,
            timeout_s=TIMEOUT_S,
            store=store_client(ADDR, port, TIMEOUT_S),
        )
        assert rank_1.stdout is not None
        assert rank_1.stdout.readline() == "joined\n"

        # The sender's broadcast, as the sender runs it (a daemon thread, the sender's own
        # `_broadcast`), stuck: rank 1 does not receive.
        sender = WeightSender([object()], master_port=port)  # type: ignore[list-item]
        sender._group = group
        ended = threading.Event()
        send = _in_daemon_thread(lambda: sender._broadcast([torch.zeros(ELEMENTS)]), ended=ended)
        assert not ended.wait(1.0), "the broadcast is not stuck"

        # Given up, as `WeightSender._watch` does on a refusal; the collective still runs.
        sender._group = None
        abandon_weight_group(group, ended)
        del group
        assert reap_abandoned_groups() == 1, "a running group was destroyed"

        # The engine's side closes (it restarts): the collective fails at once, and ends.
        rank_1.kill()
        rank_1.wait(10)
        rank_1.stdout.close()
        with pytest.raises(RuntimeError, match="closed by peer"):
            await asyncio.wait_for(send, TIMEOUT_S)
        del send
        assert ended.is_set()

        assert reap_abandoned_groups() == 0
        assert not held
        assert settled(before) == before  # its sockets, device, store connection and threads
    finally:
        if rank_1.poll() is None:
            rank_1.kill()
            rank_1.wait(10)


def test_a_running_group_is_kept_and_an_idle_one_destroyed(
    held: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    destroyed: list[object] = []
    monkeypatch.setattr(group_mod, "destroy_weight_group", destroyed.append)
    running, idle, finished = object(), object(), object()
    still_running, ended = threading.Event(), threading.Event()
    ended.set()

    abandon_weight_group(running, still_running)  # its collective is still in flight
    abandon_weight_group(idle)  # no collective in flight when it was given up
    abandon_weight_group(finished, ended)  # its collective has ended since

    assert reap_abandoned_groups() == 1
    assert destroyed == [idle, finished]
    assert [g for g, _ in held] == [running]
    assert reap_abandoned_groups() == 1 and destroyed == [idle, finished]

    still_running.set()
    assert reap_abandoned_groups() == 0
    assert destroyed == [idle, finished, running]
    assert not held


async def test_the_sender_hands_over_its_running_collective_and_reaps_at_push(
    held: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    destroyed: list[object] = []
    monkeypatch.setattr(group_mod, "destroy_weight_group", destroyed.append)
    sender = WeightSender([object()], master_port=0)  # type: ignore[list-item]
    sender.refusal_grace_s = 0.05
    peer_gone = threading.Event()

    def broadcast(tensors: list[torch.Tensor]) -> None:  # stuck until the engine's side closes
        peer_gone.wait(5)
        raise RuntimeError("Connection closed by peer")

    sender._broadcast = broadcast  # type: ignore[method-assign]
    group = sender._group = object()

    async def refuse() -> None:
        raise RuntimeError("HTTP 503: refused")

    with pytest.raises(Exception, match="reconnect"):
        await sender._broadcast_watching([], [asyncio.create_task(refuse())])
    assert [g for g, _ in held] == [group]
    assert sender._abandoned == [sender.group_name]  # the engines free it at the next connect
    with pytest.raises(RuntimeError, match="connect"):
        await sender.push([])  # reaps first: the collective still runs
    assert destroyed == []

    peer_gone.set()
    ended = held[0][1]
    assert await asyncio.to_thread(ended.wait, 5)
    with pytest.raises(RuntimeError, match="connect"):
        await sender.push([])
    assert destroyed == [group] and not held

    idle = sender._group = object()  # a group given up between pushes (`set_engines`)
    sender.disconnect()
    assert sender._abandoned == [sender.group_name] * 2  # (never connected: one name)
    with pytest.raises(RuntimeError, match="connect"):
        await sender.push([])
    assert destroyed == [group, idle] and not held
