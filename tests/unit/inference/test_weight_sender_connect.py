"""`WeightSender.connect` returns only once every engine has answered its join: an engine
registers the group after the rendezvous, and a bucket naming the group before that was
refused ("no weight update group ...: call init first", a flaky push seen in CI)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from searchr1.redis_server import free_port
from searchr1.weightsync.protocol import GroupJoin
from searchr1.weightsync.sender import WeightSender

# The engine's rank lives in a process of its own (one process cannot hold both ranks).
JOIN = """
import sys
from searchr1.weightsync.group import new_weight_group
addr, port, world, rank, name = sys.argv[1:]
new_weight_group(backend="gloo", master_address=addr, master_port=int(port),
                 world_size=int(world), rank=int(rank), group_name=name, timeout_s=30)
print("joined", flush=True)
sys.stdin.read()
"""


class SlowRegisteringEngine:
    """Joins the rendezvous like an engine, then takes a while before the group is usable
    (our engine frees its stale groups first)."""

    def __init__(self) -> None:
        self.registered: str | None = None
        self.proc: asyncio.subprocess.Process | None = None

    async def init_weights_update_group(self, join: GroupJoin) -> None:
        args = (join.master_address, join.master_port, join.world_size, join.rank_offset)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", JOIN, *map(str, args), join.group_name,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert await self.proc.stdout.readline() == b"joined\n"
        await asyncio.sleep(0.5)
        self.registered = join.group_name

    async def get_model_info(self) -> dict[str, Any]:
        return {"weight_version": 0, "dtype": "float32"}

    async def destroy_weights_update_group(self, group_name: str) -> bool:
        return True

    async def aclose(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            await self.proc.wait()


async def test_connect_waits_for_every_engine_to_register_the_group() -> None:
    engine = SlowRegisteringEngine()
    sender = WeightSender([engine], master_port=free_port(), timeout_s=30)  # type: ignore[list-item]
    try:
        await asyncio.wait_for(sender.connect(), 30)
        assert engine.registered == sender.group_name
    finally:
        await sender.close()
