"""A process group for weight broadcasts, separate from torch.distributed's default group.

The trainer may already own the default group (FSDP), and SGLang owns its own (tensor
parallelism), so the weight channel is a third, independent group: a fresh TCP rendezvous on
`master_address:master_port`, a `PrefixStore` named after the group, and a backend built by
torch's own helper without touching the default group. This is the layout SGLang's
`init_custom_process_group` uses, so our sender also talks to a real SGLang server.
The trainer's sender is rank 0; engines join as ranks `rank_offset .. rank_offset + n - 1`.
A group given up on after a failed push (`abandon_weight_group`) is held until its collective
has ended, then destroyed by `reap_abandoned_groups` (the sender reaps at each connect and
push). Also here: the wire's dtype names as the torch dtypes the broadcast tensors have.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import logging
import threading
from datetime import timedelta
from typing import Any

import torch
from prometheus_client import Gauge

from searchr1.weightsync.protocol import DTYPE_NAMES

log = logging.getLogger(__name__)

ABANDONED_GROUPS = Gauge(
    "searchr1_weight_groups_abandoned",
    "Weight groups this process gave up on after a failed push and still holds, each with its "
    "sockets and threads: their collective has not ended yet, or no connect or push has come "
    "since it did (each is destroyed then)",
)

# The wire's dtype names (`protocol.DTYPE_NAMES`) as torch dtypes.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def dtype_from_name(name: str) -> torch.dtype:
    """`"bfloat16"` or `"torch.bfloat16"` -> torch.bfloat16; ValueError for anything else."""
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (known: {sorted(DTYPES)})")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def host_store(master_address: str, master_port: int, timeout_s: float = 600.0) -> Any:
    """The rendezvous server a sender (rank 0) runs on `master_port` for its whole life.

    One server for every connection of the sender (each under its own group-name prefix, each
    with its own `store_client`): a connection that failed leaves its joining thread blocked
    in a wait on its store, and a second server on the same port cannot start (EADDRINUSE)."""
    from torch.distributed import TCPStore

    return TCPStore(
        master_address,
        master_port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def store_client(master_address: str, master_port: int, timeout_s: float = 600.0) -> Any:
    """A connection of its own to a `host_store` (a store blocks all its users while one
    thread waits on it)."""
    from torch.distributed import TCPStore

    return TCPStore(
        master_address, master_port, is_master=False, timeout=timedelta(seconds=timeout_s)
    )


def new_weight_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 600.0,
    store: Any = None,
) -> Any:
    """Join (rank 0: host) the group; blocks until all `world_size` ranks have joined.
    `store`: rank 0's `host_store` (default: a rendezvous on `master_address:master_port`)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(
            rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
        )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # The keyword was renamed across torch releases (pg_options -> backend_options).
    params = inspect.signature(_new_process_group_helper).parameters
    options_kw = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **{options_kw: None},
    )
    # Identity rank map so torch.distributed.broadcast(..., group=group) resolves src ranks.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_group(group: Any) -> None:
    """Unregister the group (its name becomes reusable) and shut its backend down."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):  # best effort: the peer may already be gone
        dist.destroy_process_group(group)


# Groups given up on and not destroyed yet, each with what tells that its collective has ended
# (None: none was in flight). Each also holds one reference of its own (`Py_IncRef`), dropped
# when it is reaped: a group still here at interpreter exit is never destroyed, so the exit
# does not wait for a collective stuck in it.
_ABANDONED: list[tuple[Any, threading.Event | None]] = []
_ABANDONED_LOCK = threading.Lock()


def abandon_weight_group(group: Any, collective_ended: threading.Event | None = None) -> None:
    """Give up on a group whose collective may never finish (a peer refused to join it, or
    left): `collective_ended` is set once the collective last started on it has ended (None:
    none is in flight).

    A gloo collective cannot be cancelled: destroying its group waits for the collective's
    timeout, and so would interpreter exit, when the last reference goes. The group is aborted
    where the backend supports it (gloo does not) and kept alive, by a reference that is never
    dropped while its collective runs, so the process can still exit at once; once the
    collective has ended (failed: its peer left, or its timeout passed), the next
    `reap_abandoned_groups` destroys it, which frees its sockets, store connection and threads
    (about 6 fds and 3 threads for a gloo group of two).
    """
    with contextlib.suppress(Exception):
        group.abort()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    with _ABANDONED_LOCK:
        _ABANDONED.append((group, collective_ended))
        ABANDONED_GROUPS.set(len(_ABANDONED))


def reap_abandoned_groups() -> int:
    """Destroy every abandoned group whose collective has ended; keep the others (a running
    collective would block the destruction until its timeout). Returns how many are kept.
    Cheap when there is nothing to reap: the sender calls it at each connect and push."""
    ended: list[tuple[Any, threading.Event | None]] = []
    with _ABANDONED_LOCK:
        running: list[tuple[Any, threading.Event | None]] = []
        for group, done in _ABANDONED:  # one look at each event: it may be set meanwhile
            (ended if done is None or done.is_set() else running).append((group, done))
        _ABANDONED[:] = running
        kept = len(running)
        ABANDONED_GROUPS.set(kept)
    for group, _ in ended:
        destroy_weight_group(group)
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(group))  # `abandon_weight_group`'s own
    if ended:
        log.info("abandoned weight groups destroyed", extra={"destroyed": len(ended), "kept": kept})
    elif kept:
        log.debug("abandoned weight groups kept: collective running", extra={"kept": kept})
    return kept
