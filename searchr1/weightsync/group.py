"""A process group for weight broadcasts, separate from torch.distributed's default group.

The trainer may already own the default group (FSDP), and SGLang owns its own (tensor
parallelism), so the weight channel is a third, independent group: a fresh TCP rendezvous on
`master_address:master_port`, a `PrefixStore` named after the group, and a backend built by
torch's own helper without touching the default group. This is the layout SGLang's
`init_custom_process_group` uses, so our sender also talks to a real SGLang server.
The trainer's sender is rank 0; engines join as ranks `rank_offset .. rank_offset + n - 1`.
Also here: the wire's dtype names as the torch dtypes the broadcast tensors have.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
from datetime import timedelta
from typing import Any

import torch

from searchr1.weightsync.protocol import DTYPE_NAMES

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


def abandon_weight_group(group: Any) -> None:
    """Give up on a group whose collective can never finish (a peer refused to join it).

    A gloo collective cannot be cancelled: destroying its group waits for the collective's
    timeout, and so would interpreter exit, when the last reference goes. The group is aborted
    where the backend supports it and otherwise kept alive for good (one group per failed push,
    a few KB), so the process can still exit at once.
    """
    with contextlib.suppress(Exception):
        group.abort()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
