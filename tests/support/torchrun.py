"""Launching a script on several local ranks with torchrun, for multi-process trainer tests."""

from __future__ import annotations

import os
import sys

from searchr1.redis_server import free_port


def torchrun(ranks: int, *args: str) -> list[str]:
    """`python -m torch.distributed.run` on `ranks` processes with a free rendezvous port (not
    `--master-port 0`: its workers then get port 0 and never rendezvous)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-port",
        str(free_port()),
        *args,
    ]


def torchrun_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
