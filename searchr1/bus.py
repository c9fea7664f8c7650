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
- Poison entries: `Delivery.delivery_count` is Redis's own count; an entry handed out more than
  `max_deliveries` times (its consumer keeps dying on it) is dead-lettered instead of delivered.
  A consumer can dead-letter what it holds (`dead_letter`) and, before crashing because of some
  entries, spare the others that crash's delivery (`forgive_held`). Dead ids count as consumed.
- Redis connection loss: every operation goes through the stack's retry policy
  (`searchr1.redis_retry`) for up to `reconnect_timeout_s`; a lost consumer group (Redis
  restarted without persistence) is recreated. With AOF (`appendfsync always`) nothing
  published is lost across a restart.

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
DEAD_LETTERS = Counter(
    "searchr1_bus_dead_letters_total", "Entries moved to the dead-letter stream", ["reason"]
)
# Exported at 0 from start-up (a dashboard's rate() shows 0, not "No data"): the bus's own
# reasons, then those the trainer passes to `dead_letter`.
DEAD_LETTER_REASONS = (
    "missing_data",
    "bad_version",
    "unknown_version",
    "undecodable",
    "max_deliveries",
    "incomplete_group",
    "train_error",
)
for _reason in DEAD_LETTER_REASONS:
    DEAD_LETTERS.labels(_reason)
# Every op this module passes to its Redis retry policy (tests check the list is complete).
REDIS_OPS = (
    "ack",
    "backlog",
    "dead_letter",
    "dead_letters",
    "dedup",
    "delivery_counts",
    "end",
    "ended",
    "ensure_group",
    "forgive",
    "heartbeat",
    "pending",
    "publish",
    "read",
    "read_pending",
    "reclaim",
    "reopen",
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


class Fenced(RuntimeError):
    """An ack refused by Redis: this consumer no longer holds the lease it was fenced with."""


# Mark the ids consumed, then XACK + XDEL, in one atomic script. Fenced (a third key, the
# trainer lease): only while that key still holds our token, checked in the same step, so a
# trainer paused past its lease cannot ack what the new holder will train again.
# KEYS: done set, stream[, lease]; ARGV: token, now, retention_s, group, n_tids, tids..., ids...
_ACK_LUA = """
if #KEYS == 3 then
  local v = redis.call('GET', KEYS[3])
  if not v or cjson.decode(v)['token'] ~= ARGV[1] then
    return redis.error_reply('FENCED the trainer lease is no longer ours')
  end
end
local now = tonumber(ARGV[2])
local n = tonumber(ARGV[5])
for i = 1, n do
  redis.call('ZADD', KEYS[1], now, ARGV[5 + i])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
for i = 6 + n, #ARGV do
  redis.call('XACK', KEYS[2], ARGV[4], ARGV[i])
  redis.call('XDEL', KEYS[2], ARGV[i])
end
return n
"""


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


_RawEntries = list[tuple[bytes, dict[bytes, bytes] | None]]


class _Dead(NamedTuple):
    """One entry on its way to the dead-letter stream."""

    entry_id: str
    fields: dict[bytes, bytes]  # the original entry's (v, tid, data) when there were any
    reason: str  # short label: the metric's and the CLI's
    error: str  # what went wrong, for a human
    deliveries: int
    tid: str | None = None  # marked consumed when set (a malformed entry's id is not trusted)

    def record(self) -> dict[bytes, bytes]:
        return {
            **self.fields,
            b"reason": self.reason.encode(),
            b"error": self.error.encode(),
            b"source_id": self.entry_id.encode(),
            b"deliveries": str(self.deliveries).encode(),
        }


def fields_of(traj: Trajectory) -> dict[bytes, bytes]:
    """The stream fields of a trajectory, as `publish` writes them."""
    return {
        b"v": str(traj.schema_version).encode(),
        b"tid": traj.trajectory_id.encode(),
        b"data": encode(traj),
    }


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
        self.end_key = f"{config.stream}:end"  # the producer's "nothing more is coming"
        # trajectory id -> entry ids this consumer holds unacked (the first is the delivery).
        self._inflight: dict[str, list[str]] = {}
        self._own_pending_done = False
        self._own_cursor = "0"
        self._claim_cursor = "0-0"
        self._group_ready = False
        self._publish_script = client.register_script(_PUBLISH_LUA)
        self._ack_script = client.register_script(_ACK_LUA)
        self.fence: tuple[str, str] | None = None  # (lease key, token) that acks require
        self.retry = RedisRetry("bus", config.reconnect_timeout_s, error=BusUnavailable)
        self.retry.declare(REDIS_OPS)

    @classmethod
    def from_url(cls, url: str, config: BusConfig) -> TrajectoryBus:
        client = connect(
            url,
            decode_responses=False,
            health_check_interval=10,
            socket_timeout_s=config.socket_timeout_s,
            tcp_timeout_s=config.tcp_timeout_s,
        )
        return cls(client, config)

    async def close(self) -> None:
        await self.redis.aclose()

    def fence_with(self, lease_key: str, token: str) -> None:
        """From now on an ack goes through only while `lease_key` holds `token` (RedisLease)."""
        self.fence = (lease_key, token)

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

    async def end(self, reason: str) -> None:
        """The producer will publish nothing more (its data ran out): a consumer waiting for
        more stops with `reason` instead of waiting forever. `reopen` clears it."""
        await self._retrying("end", lambda: self.redis.set(self.end_key, reason.encode()))

    async def ended(self) -> str | None:
        """The producer's reason for publishing nothing more, or None while it may."""
        raw = await self._retrying("ended", lambda: self.redis.get(self.end_key))
        return None if raw is None else raw.decode()

    async def reopen(self) -> None:
        """A fresh run on this stream: publishing may go on (clears `end`)."""
        await self._retrying("reopen", lambda: self.redis.delete(self.end_key))

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
            out += await self._read_new(batch_size - len(out), None if out else block)
        DELIVERED.inc(len(out))
        return out

    async def _read_own_pending(self, count: int) -> list[Delivery]:
        # Paged by a cursor: re-reading from "0" would return the same first page forever.
        resp = await self._retrying(
            "read_pending",
            lambda: self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: self._own_cursor}, count=count
            ),
        )
        entries = resp[0][1] if resp else []
        if entries:
            self._own_cursor = _s(entries[-1][0])
        if len(entries) < count:
            self._own_pending_done = True
        held = self._held_entry_ids()
        fresh = [(eid, f) for eid, f in entries if _s(eid) not in held]
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

    async def _read_new(self, count: int, block: float | None) -> list[Delivery]:
        """New entries; waits up to `block` seconds for the first. The wait is cut into
        XREADGROUP BLOCKs of half the socket timeout: a longer one would end in the socket
        timeout, which is what a frozen Redis looks like, and be retried as an outage."""
        deadline = time.monotonic() + (block or 0.0)
        slice_s = self.config.socket_timeout_s / 2
        while True:
            left = deadline - time.monotonic()
            block_ms = max(1, int(min(left, slice_s) * 1000)) if block else None
            resp = await self._retrying(
                "read",
                lambda ms=block_ms: self.redis.xreadgroup(  # type: ignore[misc]
                    self.group, self.consumer, {self.stream: ">"}, count=count, block=ms
                ),
            )
            entries = resp[0][1] if resp else []
            if entries or not block or time.monotonic() >= deadline:
                return await self._accept(entries, redelivered=False)

    def _held_entry_ids(self) -> set[str]:
        return {eid for eids in self._inflight.values() for eid in eids}

    async def _delivery_counts(self, entry_ids: Sequence[str]) -> dict[str, int]:
        """Redis's delivery count of each entry this consumer holds (XPENDING); an entry that is
        no longer pending on this consumer (acked or claimed meanwhile) is left out."""
        if not entry_ids:
            return {}

        async def run() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for eid in entry_ids:
                    pipe.xpending_range(self.stream, self.group, min=eid, max=eid, count=1)
                return list(await pipe.execute())

        out: dict[str, int] = {}
        for rows in await self._retrying("delivery_counts", run):
            for row in rows:
                if _s(row["consumer"]) == self.consumer:
                    out[_s(row["message_id"])] = int(row["times_delivered"])
        return out

    async def _accept(self, entries: _RawEntries, *, redelivered: bool) -> list[Delivery]:
        """Decode, drop what was consumed before, dead-letter the malformed and the entries
        delivered too often, register the rest as held."""
        counts: dict[str, int] = {}
        if redelivered:
            # XREADGROUP of own pending and XAUTOCLAIM both counted this delivery in Redis.
            counts = await self._delivery_counts([_s(eid) for eid, _ in entries])
        dead: list[_Dead] = []
        decoded: list[tuple[str, Trajectory, int]] = []
        for raw_id, fields in entries:
            entry_id = _s(raw_id)
            if redelivered and entry_id not in counts:
                continue  # acked or claimed by someone else since: not ours
            traj, reason, error = self._decode_entry(fields)
            if traj is None:
                dead.append(_Dead(entry_id, fields or {}, reason, error, counts.get(entry_id, 1)))
                continue
            decoded.append((entry_id, traj, counts.get(entry_id, 1)))
        out: list[Delivery] = []
        stale: list[tuple[str, str]] = []
        if decoded:
            tids = [t.trajectory_id for _, t, _ in decoded]
            scores = await self._retrying("dedup", lambda: self.redis.zmscore(self.done_key, tids))
            for (entry_id, traj, n), done_at in zip(decoded, scores, strict=True):
                tid = traj.trajectory_id
                if done_at is not None:
                    stale.append((entry_id, tid))  # consumed (or dead) before: ack it away
                    continue
                if n > self.config.max_deliveries:
                    # Handed out that often and never acked: it kills or fails its consumer.
                    error = (
                        f"delivered {n} times, more than bus.max_deliveries="
                        f"{self.config.max_deliveries}, never acknowledged"
                    )
                    dead.append(
                        _Dead(entry_id, fields_of(traj), "max_deliveries", error, n, tid=tid)
                    )
                    continue
                if tid in self._inflight:
                    self._inflight[tid].append(entry_id)  # acked together with the original
                    DUPLICATES.inc()
                    continue
                self._inflight[tid] = [entry_id]
                out.append(Delivery(entry_id, traj, n))
        if dead:
            await self._move_to_dead(dead)
        if stale:
            DUPLICATES.inc(len(stale))
            log.info("skipped already-consumed trajectories", extra={"count": len(stale)})
            await self._ack_entries([eid for eid, _ in stale], [tid for _, tid in stale])
        return out

    @staticmethod
    def _decode_entry(
        fields: dict[bytes, bytes] | None,
    ) -> tuple[Trajectory | None, str, str]:
        """(trajectory, "", "") or (None, reason, error)."""
        if not fields or b"data" not in fields:
            return None, "missing_data", "the entry has no data field"
        try:
            version = int(fields.get(b"v", b"-1"))
        except ValueError:
            return None, "bad_version", f"schema version {fields.get(b'v')!r} is not a number"
        if version not in SUPPORTED_VERSIONS:
            known = sorted(SUPPORTED_VERSIONS)
            return (
                None,
                "unknown_version",
                f"schema version {version} (this consumer reads {known})",
            )
        try:
            return decode(fields[b"data"]), "", ""
        except SchemaError as e:
            return None, "undecodable", str(e)

    async def _move_to_dead(self, rows: Sequence[_Dead], also_ack: Sequence[str] = ()) -> None:
        """Append each row to the dead-letter stream and ack + delete its entry (and the
        `also_ack` entries: duplicates held with them) in one transaction. Trajectory ids are
        marked consumed, so a republished copy is not trained either."""
        tids = [r.tid for r in rows if r.tid is not None]
        entry_ids = [r.entry_id for r in rows] + list(also_ack)
        now = time.time()

        async def move() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                for r in rows:
                    pipe.xadd(self.dead_stream, r.record())
                if tids:
                    pipe.zadd(self.done_key, dict.fromkeys(tids, now))
                pipe.xack(self.stream, self.group, *entry_ids)
                pipe.xdel(self.stream, *entry_ids)
                await pipe.execute()

        await self._retrying("dead_letter", move)
        for r in rows:
            DEAD_LETTERS.labels(r.reason).inc()
        by_reason: dict[str, list[str]] = {}
        for r in rows:
            by_reason.setdefault(r.reason, []).append(r.tid or r.entry_id)
        for reason, ids in by_reason.items():
            log.warning(
                "dead-lettered bus entries",
                extra={
                    "reason": reason,
                    "count": len(ids),
                    "trajectory_ids": ids[:20],
                    "error": next(r.error for r in rows if r.reason == reason)[:500],
                    "dead_stream": self.dead_stream,
                },
            )

    async def dead_letter(self, deliveries: Sequence[Delivery], reason: str, error: str) -> int:
        """Move held deliveries to the dead-letter stream with `reason` (a short label, the
        metric's) and `error` (what went wrong); they are acked and never delivered again."""
        rows: list[_Dead] = []
        also_ack: list[str] = []
        for d in deliveries:
            held = self._inflight.pop(d.trajectory_id, [])
            also_ack += [eid for eid in held if eid != d.entry_id]
            rows.append(
                _Dead(
                    d.entry_id,
                    fields_of(d.trajectory),
                    reason,
                    error,
                    d.delivery_count,
                    tid=d.trajectory_id,
                )
            )
        if rows:
            await self._move_to_dead(rows, also_ack)
        return len(rows)

    async def forgive_held(self, keep: Iterable[Delivery] = ()) -> int:
        """Take back the current delivery of every held entry but `keep`'s: called when the
        consumer is about to crash because of `keep` (a failed batch), so its restart does not
        count against the innocent entries it held beside them (`max_deliveries`)."""
        kept = {eid for d in keep for eid in self._inflight.get(d.trajectory_id, [d.entry_id])}
        ids = sorted(self._held_entry_ids() - kept)
        by_count: dict[int, list[str]] = {}
        for eid, n in (await self._delivery_counts(ids)).items():
            by_count.setdefault(max(n - 1, 0), []).append(eid)
        if not by_count:
            return 0

        async def run() -> None:
            async with self.redis.pipeline(transaction=False) as pipe:
                for n, eids in by_count.items():
                    # JUSTID: no new delivery is counted; RETRYCOUNT sets the count.
                    pipe.xclaim(
                        self.stream, self.group, self.consumer, 0, eids, retrycount=n, justid=True
                    )
                await pipe.execute()

        await self._retrying("forgive", run)
        return sum(len(v) for v in by_count.values())

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
        keys = [self.done_key, self.stream]
        token = ""
        if self.fence is not None:
            keys.append(self.fence[0])
            token = self.fence[1]
        args = [token, time.time(), self.config.dedup_retention_s, self.group, len(tids)]

        async def run() -> None:
            try:
                await self._ack_script(keys=keys, args=[*args, *tids, *entry_ids])
            except ResponseError as e:
                if "FENCED" in str(e):
                    raise Fenced(f"ack refused: {keys[2]} {str(e).partition(' ')[2]}") from None
                raise

        await self._retrying("ack", run)

    # -- inspection -----------------------------------------------------------------------

    async def dead_letters(self, count: int = 100) -> list[dict[str, Any]]:
        rows = await self._retrying(
            "dead_letters", lambda: self.redis.xrange(self.dead_stream, count=count)
        )
        return [{"id": _s(eid), **{_s(k): v for k, v in fields.items()}} for eid, fields in rows]

    async def dead_letter_count(self) -> int:
        return int(await self._retrying("dead_letters", lambda: self.redis.xlen(self.dead_stream)))

    async def pending_count(self) -> int:
        info = await self._retrying("pending", lambda: self.redis.xpending(self.stream, self.group))
        return int(info["pending"])
