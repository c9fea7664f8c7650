"""The trajectory bus: a durable queue of `Trajectory` messages on a Redis stream.

Producer (orchestrator): `publish(trajectories)`. Consumer (trainer): `consume(n, block)`, then
`ack(deliveries)` once the work is durable (after the optimizer step / checkpoint).

Guarantees:
- At-least-once delivery with a consumer group; exactly-once *consumption* by trajectory id:
  acknowledged ids go into a "done" set (kept `dedup_retention_s`), and a redelivered or
  republished trajectory that is done, or already held by this consumer, is never returned again.
- A dead consumer's entries stay pending and are reclaimed by another consumer after
  `reclaim_idle_s` (XAUTOCLAIM). A consumer restarted under the same name first gets back its
  own pending entries. Long-held entries are kept fresh by `heartbeat()` so they are not stolen.
- Back-pressure: `publish` waits while the unacknowledged backlog (undelivered + pending) would
  exceed `max_backlog`. Acked entries are deleted (XACK + XDEL in one transaction), so the stream
  length *is* the backlog and nothing unacknowledged is ever trimmed. The check-and-append is
  one Lua script, so concurrent producers cannot overshoot the bound.
- A malformed or unknown-version entry is moved to the dead-letter stream `<stream>:dead`
  (counted, logged once) and consumption continues.
- Redis connection loss: every operation retries with exponential backoff for up to
  `reconnect_timeout_s`; a lost consumer group (Redis restarted without persistence) is
  recreated. With AOF (`appendfsync always`) nothing published is lost across a restart.

One consumer group per stream (the trainer's); several consumers may share it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.exceptions import ResponseError

from protos.trajectory import SUPPORTED_VERSIONS, SchemaError, Trajectory, decode, encode
from searchr1.redis_retry import RedisRetry, RedisUnavailable, connect
from searchr1.sections import BusConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

PUBLISHED = Counter("searchr1_bus_published_total", "Trajectories appended to the bus")
DELIVERED = Counter("searchr1_bus_delivered_total", "Trajectories handed to a consumer")
ACKED = Counter("searchr1_bus_acked_total", "Trajectories acknowledged (work durable)")
DUPLICATES = Counter(
    "searchr1_bus_duplicates_total", "Entries skipped because their trajectory id was consumed"
)
DEAD_LETTERED = Counter(
    "searchr1_bus_dead_lettered_total", "Entries moved to the dead-letter stream", ["reason"]
)
RECLAIMED = Counter("searchr1_bus_reclaimed_total", "Entries reclaimed from idle consumers")
BACKPRESSURE_WAIT = Counter(
    "searchr1_bus_backpressure_wait_seconds_total", "Time producers waited on a full backlog"
)
BACKLOG = Gauge("searchr1_bus_backlog", "Unacknowledged entries (undelivered + pending)")

# Atomic "append only if the backlog stays within the bound". ARGV: max, then (v, tid, data)*.
_PUBLISH_LUA = """
local n = (#ARGV - 1) / 3
if redis.call('XLEN', KEYS[1]) + n > tonumber(ARGV[1]) then return false end
local ids = {}
for i = 0, n - 1 do
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*',
    'v', ARGV[2 + 3 * i], 'tid', ARGV[3 + 3 * i], 'data', ARGV[4 + 3 * i])
end
return ids
"""


class BusUnavailable(RedisUnavailable):
    """Redis stayed unreachable for longer than `reconnect_timeout_s`."""


class Receipt(NamedTuple):
    """What `ack` needs; small enough to store in a checkpoint."""

    entry_id: str
    trajectory_id: str


@dataclass(frozen=True)
class Delivery:
    entry_id: str
    trajectory: Trajectory
    delivery_count: int = 1

    @property
    def trajectory_id(self) -> str:
        return self.trajectory.trajectory_id

    @property
    def receipt(self) -> Receipt:
        return Receipt(self.entry_id, self.trajectory_id)


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class TrajectoryBus:
    def __init__(self, client: aioredis.Redis, config: BusConfig) -> None:
        self.redis = client
        self.config = config
        self.stream = config.stream
        self.group = config.group
        self.consumer = config.consumer or default_consumer_name()
        self.dead_stream = f"{config.stream}:dead"
        self.done_key = f"{config.stream}:done"
        # trajectory id -> entry ids this consumer holds unacked (the first is the delivery).
        self._inflight: dict[str, list[str]] = {}
        self._own_pending_done = False
        self._claim_cursor = "0-0"
        self._group_ready = False
        self._publish_script = client.register_script(_PUBLISH_LUA)
        self.retry = RedisRetry("bus", config.reconnect_timeout_s, error=BusUnavailable)

    @classmethod
    def from_url(cls, url: str, config: BusConfig) -> TrajectoryBus:
        # No socket timeout: XREADGROUP BLOCK holds the connection open by design.
        return cls(connect(url, decode_responses=False, health_check_interval=10), config)

    async def close(self) -> None:
        await self.redis.aclose()

    # -- plumbing -------------------------------------------------------------------------

    async def _retrying(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run `fn` under the stack's Redis retry policy; recreate a lost consumer group."""

        async def guarded() -> T:
            try:
                return await fn()
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                log.warning("consumer group missing; recreating", extra={"op": op})
                self._group_ready = False
                await self.ensure_group()
                return await fn()

        return await self.retry.call(op, guarded)

    async def ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            # From "0": entries published before the trainer first connected are consumed too.
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    async def ping(self) -> str:
        """Readiness check: Redis answers and the group exists."""
        await self.redis.ping()
        await self.ensure_group()
        return f"stream {self.stream}, backlog {await self.redis.xlen(self.stream)}"

    # -- producer -------------------------------------------------------------------------

    async def backlog(self) -> int:
        n = int(await self._retrying("backlog", lambda: self.redis.xlen(self.stream)))
        BACKLOG.set(n)
        return n

    async def publish(self, trajectories: Sequence[Trajectory]) -> list[str]:
        """Append trajectories atomically; wait while the backlog bound would be exceeded.

        Returns the stream entry ids. Raises SchemaError for an invalid trajectory (before
        anything is written) and ValueError for a batch larger than the bound itself.
        """
        if not trajectories:
            return []
        if len(trajectories) > self.config.max_backlog:
            raise ValueError(
                f"batch of {len(trajectories)} exceeds bus.max_backlog={self.config.max_backlog}"
            )
        args: list[Any] = [self.config.max_backlog]
        for traj in trajectories:
            args += [str(traj.schema_version), traj.trajectory_id, encode(traj)]
        await self._retrying("ensure_group", self.ensure_group)
        waited_since: float | None = None
        while True:
            ids = await self._retrying(
                "publish", lambda: self._publish_script(keys=[self.stream], args=args)
            )
            if ids:
                break
            if waited_since is None:
                waited_since = time.monotonic()
                log.debug("backlog full; producer waiting", extra={"batch": len(trajectories)})
            await asyncio.sleep(self.config.backpressure_poll_s)
        if waited_since is not None:
            BACKPRESSURE_WAIT.inc(time.monotonic() - waited_since)
        PUBLISHED.inc(len(ids))
        return [_s(i) for i in ids]

    # -- consumer -------------------------------------------------------------------------

    async def consume(self, batch_size: int, block: float | None = None) -> list[Delivery]:
        """Up to `batch_size` new deliveries; waits up to `block` seconds when none is ready.

        Order of sources: this consumer's own pending entries (after a restart), entries
        reclaimed from idle consumers, then new entries.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        await self._retrying("ensure_group", self.ensure_group)
        await self.heartbeat()
        out: list[Delivery] = []
        if not self._own_pending_done:
            out += await self._read_own_pending(batch_size)
        if len(out) < batch_size:
            out += await self._reclaim(batch_size - len(out))
        if len(out) < batch_size:
            block_ms = None if not block or out else max(1, int(block * 1000))
            out += await self._read_new(batch_size - len(out), block_ms)
        DELIVERED.inc(len(out))
        return out

    async def _read_own_pending(self, count: int) -> list[Delivery]:
        resp = await self._retrying(
            "read_pending",
            lambda: self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: "0"}, count=count
            ),
        )
        entries = resp[0][1] if resp else []
        fresh = [(eid, f) for eid, f in entries if _s(eid) not in self._held_entry_ids()]
        if len(entries) < count:
            self._own_pending_done = True
        return await self._accept(fresh, redelivered=True)

    async def _reclaim(self, count: int) -> list[Delivery]:
        min_idle_ms = int(self.config.reclaim_idle_s * 1000)
        resp = await self._retrying(
            "reclaim",
            lambda: self.redis.xautoclaim(
                self.stream,
                self.group,
                self.consumer,
                min_idle_time=min_idle_ms,
                start_id=self._claim_cursor,
                count=count,
            ),
        )
        self._claim_cursor = _s(resp[0])
        held = self._held_entry_ids()
        # Entries already held by this consumer can show up when a step outlives the idle
        # time; they are ours, not new work.
        claimed = [(eid, f) for eid, f in resp[1] if eid is not None and _s(eid) not in held]
        if claimed:
            RECLAIMED.inc(len(claimed))
            log.info("reclaimed idle entries", extra={"count": len(claimed)})
        return await self._accept(claimed, redelivered=True)

    async def _read_new(self, count: int, block_ms: int | None) -> list[Delivery]:
        resp = await self._retrying(
            "read",
            lambda: self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms
            ),
        )
        entries = resp[0][1] if resp else []
        return await self._accept(entries, redelivered=False)

    def _held_entry_ids(self) -> set[str]:
        return {eid for eids in self._inflight.values() for eid in eids}

    async def _accept(
        self, entries: list[tuple[bytes, dict[bytes, bytes] | None]], *, redelivered: bool
    ) -> list[Delivery]:
        """Decode, dead-letter the malformed, drop duplicates, register the rest as held."""
        decoded: list[tuple[str, Trajectory]] = []
        for raw_id, fields in entries:
            entry_id = _s(raw_id)
            traj, reason = self._decode_entry(fields)
            if traj is None:
                await self._dead_letter(entry_id, fields or {}, reason)
                continue
            decoded.append((entry_id, traj))
        if not decoded:
            return []
        tids = [t.trajectory_id for _, t in decoded]
        scores = await self._retrying("dedup", lambda: self.redis.zmscore(self.done_key, tids))
        out: list[Delivery] = []
        stale: list[tuple[str, str]] = []
        for (entry_id, traj), done_at in zip(decoded, scores, strict=True):
            tid = traj.trajectory_id
            if done_at is not None:
                stale.append((entry_id, tid))  # consumed before: ack it away
                continue
            if tid in self._inflight:
                self._inflight[tid].append(entry_id)  # acked together with the original
                DUPLICATES.inc()
                continue
            self._inflight[tid] = [entry_id]
            out.append(Delivery(entry_id, traj, 2 if redelivered else 1))
        if stale:
            DUPLICATES.inc(len(stale))
            log.info("skipped already-consumed trajectories", extra={"count": len(stale)})
            await self._ack_entries([eid for eid, _ in stale], [tid for _, tid in stale])
        return out

    @staticmethod
    def _decode_entry(fields: dict[bytes, bytes] | None) -> tuple[Trajectory | None, str]:
        if not fields or b"data" not in fields:
            return None, "missing_data"
        try:
            version = int(fields.get(b"v", b"-1"))
        except ValueError:
            return None, "bad_version"
        if version not in SUPPORTED_VERSIONS:
            return None, "unknown_version"
        try:
            return decode(fields[b"data"]), ""
        except SchemaError:
            return None, "undecodable"

    async def _dead_letter(self, entry_id: str, fields: dict[bytes, bytes], reason: str) -> None:
        DEAD_LETTERED.labels(reason).inc()
        log.warning(
            "dead-lettered a bus entry",
            extra={"entry_id": entry_id, "reason": reason, "dead_stream": self.dead_stream},
        )
        record = {**fields, b"error": reason.encode(), b"source_id": entry_id.encode()}

        async def move() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xadd(self.dead_stream, record)
                pipe.xack(self.stream, self.group, entry_id)
                pipe.xdel(self.stream, entry_id)
                await pipe.execute()

        await self._retrying("dead_letter", move)

    async def heartbeat(self) -> None:
        """Reset the idle time of held entries so other consumers do not reclaim them."""
        held = sorted(self._held_entry_ids())
        if not held:
            return
        await self._retrying(
            "heartbeat",
            lambda: self.redis.xclaim(self.stream, self.group, self.consumer, 0, held, justid=True),
        )

    async def ack(self, receipts: Iterable[Receipt | Delivery]) -> int:
        """Acknowledge finished work: mark the ids consumed, then XACK + XDEL atomically.

        Idempotent, so a trainer resuming from a checkpoint can re-ack its last step's receipts.
        """
        entry_ids: list[str] = []
        tids: list[str] = []
        for r in receipts:
            tids.append(r.trajectory_id)
            held = self._inflight.pop(r.trajectory_id, [])
            entry_ids += [*held, *([r.entry_id] if r.entry_id not in held else [])]
        if not tids:
            return 0
        await self._ack_entries(entry_ids, tids)
        ACKED.inc(len(tids))
        return len(tids)

    async def _ack_entries(self, entry_ids: list[str], tids: list[str]) -> None:
        now = time.time()

        async def run() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.zadd(self.done_key, dict.fromkeys(tids, now))
                pipe.zremrangebyscore(self.done_key, "-inf", now - self.config.dedup_retention_s)
                pipe.xack(self.stream, self.group, *entry_ids)
                pipe.xdel(self.stream, *entry_ids)
                await pipe.execute()

        await self._retrying("ack", run)

    # -- inspection -----------------------------------------------------------------------

    async def dead_letters(self, count: int = 100) -> list[dict[str, Any]]:
        rows = await self._retrying(
            "dead_letters", lambda: self.redis.xrange(self.dead_stream, count=count)
        )
        return [{"id": _s(eid), **{_s(k): v for k, v in fields.items()}} for eid, fields in rows]

    async def pending_count(self) -> int:
        info = await self._retrying("pending", lambda: self.redis.xpending(self.stream, self.group))
        return int(info["pending"])
