"""Several orchestrator processes on one run: a step's prompt groups are claimed through Redis.

Per step, a sorted set holds the step's group ids that are not finished yet, scored by the
deadline of their claim in Redis's own clock (0 = unclaimed). A process claims the first group
whose deadline has passed (free, or held by a process that stopped renewing: killed, or paused
past `claim_ttl_s`), runs it, and removes it when it is published or dropped. It claims only
while it has room for another group, so faster processes take more. A step is done when its set
is empty. In sync mode every process waits for that before the next step, so the next step's
weight version counts every group of this one; in async mode a process starts the next step once
it finds nothing left to claim in this one (`run_step`'s `drained`), its slowest groups still
running (orchestrator.step_window). Capacity is shared: the groups held across the steps in
flight count against one `max_groups`.

A killed process's groups are claimed again by the others once their deadline passes, or at once
by the process itself when it restarts under the same worker id; the
regenerated group carries the same trajectory ids (`run/step/prompt/sample`), so a copy the dead
process published just before dying is dropped by the bus as a duplicate, and the published-set
check (`orchestrator.markers.RunMarkers.published`) skips the group entirely when its marker was
written.

Keys (under the run's prefix): `claims:<step>` (sorted set), `owners:<step>` (hash: group id ->
worker id), `seeded:<step>` (the step's set was filled once; an empty set then means done; kept
for the last `STEPS_KEPT` steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import Counter

from orchestrator.config import PartitionConfig
from orchestrator.markers import STEPS_KEPT
from searchr1.redis_retry import RedisRetry

log = logging.getLogger(__name__)
T = TypeVar("T")

RECLAIMED = Counter(
    "searchr1_rollout_groups_reclaimed_total",
    "Groups claimed after another process's claim expired (it died or stalled)",
)
CLAIMS_LOST = Counter(
    "searchr1_rollout_claims_lost_total",
    "Groups this process stopped because its claim expired and another process took it",
)


# KEYS: claims, seeded, the seeded marker STEPS_KEPT steps back; ARGV: group ids. Fills the
# step's set once (the first process to come) and drops that old marker.
_SEED = """
if redis.call('SET', KEYS[2], '1', 'NX') then
  for i = 1, #ARGV do redis.call('ZADD', KEYS[1], 0, ARGV[i]) end
  if KEYS[3] then redis.call('DEL', KEYS[3]) end
  return 1
end
return 0
"""

# KEYS: claims, owners; ARGV: ttl_ms, worker. The first group whose claim deadline has passed
# (0 = never claimed), with its previous owner ('' if none). Redis's clock: hosts may disagree.
_CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1)
if #ids == 0 then return false end
local prev = redis.call('HGET', KEYS[2], ids[1]) or ''
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ids[1])
redis.call('HSET', KEYS[2], ids[1], ARGV[2])
return {ids[1], prev}
"""

# KEYS: claims, owners; ARGV: ttl_ms, worker, group ids. Extends the claims still held by
# `worker`; returns the ids another worker holds now (a finished group is simply gone).
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local lost = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local owner = redis.call('HGET', KEYS[2], id)
  if owner == ARGV[2] then
    redis.call('ZADD', KEYS[1], 'XX', now + ttl, id)
  elseif owner then
    table.insert(lost, id)
  end
end
return lost
"""


# KEYS: claims, owners; ARGV: worker. Hands back every group of the step `worker` holds (also
# one whose claim reply a cancellation cut off).
_RELEASE = """
local owners = redis.call('HGETALL', KEYS[2])
for i = 1, #owners, 2 do
  if owners[i + 1] == ARGV[1] then
    redis.call('ZADD', KEYS[1], 'XX', 0, owners[i])
    redis.call('HDEL', KEYS[2], owners[i])
  end
end
return 0
"""


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# Every op passed to the Redis retry policy (tests check the list is complete).
REDIS_OPS = (
    "partition_claim",
    "partition_done",
    "partition_finish",
    "partition_forget",
    "partition_left",
    "partition_renew",
    "partition_seed",
)


class StepClaims:
    """This process's share of each step's prompt groups (see the module docstring)."""

    def __init__(
        self,
        redis: Any,
        prefix: str,
        cfg: PartitionConfig,
        retry: RedisRetry,
        *,
        max_groups: int,
        room: Callable[[int], bool] | None = None,
    ) -> None:
        self.redis = redis
        self.prefix = f"{prefix}:partition"
        self.cfg = cfg
        self.retry = retry
        self.retry.declare(REDIS_OPS)  # their retry counters exported at 0 from start-up
        self.worker = cfg.worker_id or default_worker_id()
        self.max_groups = max_groups  # groups this process runs at once, over all steps
        self._held = 0  # groups this process runs now, over the steps in flight
        # Whether one more group fits, given the groups held (the orchestrator counts samples:
        # a group's finished samples free their places before the whole group is done).
        self.room = room
        self._ttl_ms = max(1, int(cfg.claim_ttl_s * 1000))
        self._seed = redis.register_script(_SEED)
        self._claim = redis.register_script(_CLAIM)
        self._renew = redis.register_script(_RENEW)
        self._release_all = redis.register_script(_RELEASE)

    def _keys(self, step: int) -> tuple[str, str, str]:
        p = self.prefix
        return f"{p}:claims:{step}", f"{p}:owners:{step}", f"{p}:seeded:{step}"

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        return await self.retry.call(op, fn)

    async def forget(self) -> None:
        """Delete every step's claim state (`--fresh`)."""

        async def delete() -> None:
            keys = [k async for k in self.redis.scan_iter(match=f"{self.prefix}:*", count=1000)]
            if keys:
                await self.redis.delete(*keys)

        await self._call("partition_forget", delete)

    async def done(self, step: int) -> bool:
        claims, _, seeded = self._keys(step)

        async def read() -> tuple[int, int]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.exists(seeded)
                pipe.zcard(claims)
                return tuple(await pipe.execute())  # type: ignore[return-value]

        was_seeded, left = await self._call("partition_done", read)
        return bool(was_seeded) and not left

    async def unfinished(self, step: int) -> int:
        """Groups of a seeded step that no process has finished (published or dropped)."""
        claims, _, _ = self._keys(step)
        return int(await self._call("partition_left", lambda: self.redis.zcard(claims)))

    async def run_step(
        self,
        step: int,
        group_ids: list[str],
        run_group: Callable[[str], Awaitable[T]],
        drained: asyncio.Event | None = None,
    ) -> list[T]:
        """Run groups of `step` claimed by this process until every group of the step is
        finished by some process; returns the results of this process's groups. `drained` is
        set once a claim finds nothing left (every group is claimed, some maybe still running)."""
        claims, owners, seeded = self._keys(step)
        retired = self._keys(step - STEPS_KEPT)[2]
        if await self._call(
            "partition_seed", lambda: self._seed(keys=[claims, seeded, retired], args=group_ids)
        ):
            log.info("step seeded", extra={"step": step, "groups": len(group_ids)})
        else:
            # Claims under our own id are a dead predecessor's (a restart keeps the id: a
            # container's hostname and pid, or `worker_id`): take them back now, not after the TTL.
            await self._release(step)
            left = await self._call("partition_left", lambda: self.redis.zcard(claims))
            log.info("joined a started step", extra={"step": step, "groups_left": left})
        tasks: dict[str, asyncio.Task[T]] = {}
        results: list[T] = []
        renewer = asyncio.create_task(self._renew_loop(step, tasks))
        try:
            while True:
                if renewer.done():  # it failed (Redis gone past its deadline): so does the step
                    renewer.result()
                claimed = None
                held = self._held
                if held < self.max_groups and (self.room is None or self.room(held)):
                    claimed = await self._call(
                        "partition_claim",
                        lambda: self._claim(
                            keys=[claims, owners], args=[self._ttl_ms, self.worker]
                        ),
                    )
                    if not claimed and drained is not None:
                        drained.set()
                if claimed:
                    gid, prev = (x.decode() if isinstance(x, bytes) else x for x in claimed)
                    if prev and prev != self.worker:
                        RECLAIMED.inc()
                        log.warning(
                            "group reclaimed from a process whose claim expired",
                            extra={"group_id": gid, "previous_owner": prev},
                        )
                    tasks[gid] = asyncio.create_task(self._run_one(step, gid, run_group))
                    self._held += 1
                    continue
                if not tasks and await self.done(step):
                    return results
                # Full, or nothing claimable now: wait for one of ours, or look again later
                # (another process's claim may expire, or its groups finish).
                if tasks:
                    finished, _ = await asyncio.wait(
                        tasks.values(), timeout=self.cfg.poll_s, return_when="FIRST_COMPLETED"
                    )
                else:
                    finished = set()
                    await asyncio.sleep(self.cfg.poll_s)
                for gid in [g for g, t in tasks.items() if t in finished]:
                    task = tasks.pop(gid)
                    self._held -= 1
                    if not task.cancelled():  # cancelled: the claim was lost (counted)
                        results.append(task.result())  # an error ends the step, as gather did
        finally:
            if drained is not None:
                drained.set()
            self._held -= len(tasks)
            renewer.cancel()
            for task in tasks.values():
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(renewer, *tasks.values(), return_exceptions=True)
            # Stopped (SIGTERM) or failed: what is left goes back at once, not after the TTL.
            await self._release(step)

    async def _run_one(self, step: int, gid: str, run_group: Callable[[str], Awaitable[T]]) -> T:
        result = await run_group(gid)
        # Published or dropped: either way finished. Whoever reclaimed it after our claim
        # expired will find it published (skipped) or finish it again harmlessly.
        claims, owners, _ = self._keys(step)

        async def finish() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.zrem(claims, gid)
                pipe.hdel(owners, gid)
                await pipe.execute()

        await self._call("partition_finish", finish)
        log.info("group done", extra={"group_id": gid, "worker": self.worker})
        return result

    async def _renew_loop(self, step: int, tasks: dict[str, asyncio.Task[Any]]) -> None:
        claims, owners, _ = self._keys(step)
        while True:
            await asyncio.sleep(self.cfg.claim_ttl_s / 3)
            held = [g for g, t in tasks.items() if not t.done()]
            if not held:
                continue
            lost = await self._call(
                "partition_renew",
                lambda held=held: self._renew(  # type: ignore[misc]
                    keys=[claims, owners], args=[self._ttl_ms, self.worker, *held]
                ),
            )
            for raw in lost:
                gid = raw.decode() if isinstance(raw, bytes) else raw
                task = tasks.get(gid)
                if task is not None and not task.done():
                    # Another process owns it now (we stalled past the TTL): stop, not twice.
                    CLAIMS_LOST.inc()
                    log.warning("claim lost; group left to its new owner", extra={"group_id": gid})
                    task.cancel()

    async def _release(self, step: int) -> None:
        claims, owners, _ = self._keys(step)
        try:  # best effort: the claims' expiry hands them over anyway
            await self._release_all(keys=[claims, owners], args=[self.worker])
        except Exception as e:
            log.warning("could not hand claims back", extra={"step": step, "error": repr(e)})
