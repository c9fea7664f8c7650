"""A run's markers in Redis: what lets a restarted orchestrator continue its run.

Keys under the run's prefix (`searchr1:orchestrator:<run.id>`):

    base_version  the engine's weight version when the run first started (set once)
    step          the next step to roll out
    published:count  how many groups the run has put on the bus (what sets the weight version the
                  next group needs)
    published:<step>  the ids of the step's groups already on the bus (a set; a re-run group is
                  skipped), kept for the last `STEPS_KEPT` steps
    record        what makes the run this run (`run_record`): data, seed, batch sizes
    slots:<step>  with dynamic sampling: the groups of the step allowed onto the bus (a set;
                  a group re-run after a crash keeps its slot), at most `slot_limit:<step>`,
                  what completes the trainer's current batch (fixed by the step's first
                  process); both kept for the last `STEPS_KEPT` steps
    published     older runs' one set of every group published (read, never written: a run in
                  that format resumes with its count)

Every call is retried while Redis is down (`RedisRetry`): a blip must not kill the process with
every in-flight sample. All of them are idempotent, so a retry is harmless.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.config import OrchestratorConfig
from searchr1.redis_retry import RedisRetry
from searchr1.sections import RunConfig

_KEYS = ("base_version", "step", "published", "published:count", "record")
# The per-step keys, dropped `STEPS_KEPT` steps on and deleted by `forget`.
_STEP_KEYS = ("published", "slots", "slot_limit")

# Steps whose per-step keys are kept: more than a run has in flight (async: two). Older ones go,
# or a key a step (and a set member a group) piles up for the whole run (bench/soak.py). None is
# needed: a restart resumes at the lowest unfinished step (`step`).
STEPS_KEPT = 8

# KEYS: the step's published set, the count, the old one-set format's set, the published set
# STEPS_KEPT steps back; ARGV: group id. Counts the group once, however often it is marked.
_MARK_PUBLISHED = """
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 and redis.call('SADD', KEYS[1], ARGV[1]) == 1 then
  redis.call('INCR', KEYS[2])
end
redis.call('DEL', KEYS[4])
return 1
"""

# KEYS: the count, the old format's set. A run first started in that format counts its groups.
_INIT_COUNT = """
redis.call('SET', KEYS[1], redis.call('SCARD', KEYS[2]), 'NX')
return 1
"""


# KEYS: slots; ARGV: group id, limit. 1 if the group holds (or now takes) one of the step's
# `limit` publish slots, 0 if they are all taken by other groups.
_TAKE_SLOT = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('SCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('SADD', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


class RunIdInUse(RuntimeError):
    """`run.id` names a run in Redis that this one must not silently continue."""


def run_record(cfg: OrchestratorConfig, run: RunConfig) -> dict[str, Any]:
    """What makes a run this run: a restart with the same values continues it."""
    d = cfg.data
    record: dict[str, Any] = {
        "train_path": d.train_path,
        "max_prompts": d.max_prompts,
        "seed": d.seed,
        "shuffle": d.shuffle,
        "epochs": cfg.epochs,
        "groups_per_step": run.groups_per_step,
        "group_size": run.group_size,
    }
    if cfg.rollout.over_sampling:  # it changes every step's prompts (only then: older records)
        record["over_sampling"] = cfg.rollout.over_sampling
    return record


def check_same_run(
    run_id: str, record: dict[str, Any], stored: Any, step: int, last_step: int | None
) -> None:
    """RunIdInUse for a run id that belongs to another run (another `record`) or that has
    nothing left to roll out (`last_step` reached: a new run reusing the id)."""
    how = "set a new run.id, or pass --fresh to forget the old run's markers"
    if stored is not None and json.loads(stored) != record:
        old = json.loads(stored)
        diff = ", ".join(
            f"{k}: {old.get(k)!r} -> {v!r}" for k, v in record.items() if old.get(k) != v
        )
        raise RunIdInUse(f"run.id {run_id!r} is a run with other settings ({diff}): {how}")
    if last_step is not None and step >= last_step:
        raise run_finished(run_id, step)


def run_finished(run_id: str, step: int) -> RunIdInUse:
    return RunIdInUse(
        f"run.id {run_id!r} has already rolled out all its {step} steps (a new run reusing the "
        "id would publish nothing): set a new run.id, or pass --fresh to forget the old run's "
        "markers"
    )


# Every op the markers pass to the Redis retry policy (tests check the list is complete).
REDIS_OPS = (
    "forget",
    "mark_published",
    "published",
    "published_count",
    "restore",
    "save_step",
    "slot_limit",
    "slots_taken",
    "take_slot",
)


class RunMarkers:
    """The markers of one run id, read and written through `retry`."""

    def __init__(self, redis: Any, prefix: str, retry: RedisRetry) -> None:
        self.redis = redis
        self.prefix = prefix
        self.retry = retry
        self.retry.declare(REDIS_OPS)  # their retry counters exported at 0 from start-up
        self._take_slot = redis.register_script(_TAKE_SLOT)
        self._mark_published = redis.register_script(_MARK_PUBLISHED)
        self._init_count = redis.register_script(_INIT_COUNT)

    def key(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    async def forget(self) -> None:
        """Delete the markers (`--fresh`): the next start is a new run."""

        async def delete() -> None:
            keys = [self.key(k) for k in _KEYS]
            for name in _STEP_KEYS:
                keys += [k async for k in self.redis.scan_iter(match=self.key(f"{name}:[0-9]*"))]
            await self.redis.delete(*keys)

        await self.retry.call("forget", delete)

    async def restore(self, version: int, record: dict[str, Any]) -> tuple[int, int, Any]:
        """(base version, next step, the stored record). On the run's first start the base
        version becomes `version` and the stored record `record`."""
        r = self.redis
        text = json.dumps(record, sort_keys=True)

        async def read() -> tuple[Any, Any, Any]:
            await r.set(self.key("base_version"), version, nx=True)
            await r.set(self.key("record"), text, nx=True)
            await self._init_count(keys=[self.key("published:count"), self.key("published")])
            return (
                await r.get(self.key("base_version")),
                await r.get(self.key("step")),
                await r.get(self.key("record")),
            )

        base, step, stored = await self.retry.call("restore", read)
        return int(base), int(step or 0), stored

    async def published(self, step: int, group_id: str) -> bool:
        """Whether the group of `step` is already on the bus."""
        keys = self.key(f"published:{step}"), self.key("published")

        async def read() -> bool:
            return any([await self.redis.sismember(k, group_id) for k in keys])

        return await self.retry.call("published", read)

    async def mark_published(self, step: int, group_id: str) -> None:
        keys = [
            self.key(f"published:{step}"),
            self.key("published:count"),
            self.key("published"),
            self.key(f"published:{step - STEPS_KEPT}"),
        ]
        await self.retry.call(
            "mark_published", lambda: self._mark_published(keys=keys, args=[group_id])
        )

    async def published_count(self) -> int:
        key = self.key("published:count")
        return int(await self.retry.call("published_count", lambda: self.redis.get(key)) or 0)

    async def take_slot(self, step: int, group_id: str, limit: int) -> bool:
        """Whether the group may publish: one of the step's `limit` slots is (now) its own."""
        key = self.key(f"slots:{step}")
        got = await self.retry.call(
            "take_slot", lambda: self._take_slot(keys=[key], args=[group_id, limit])
        )
        return bool(got)

    async def slot_limit(self, step: int, proposed: int) -> int:
        """The step's slot count: `proposed` unless a process of the run fixed it first."""
        key = self.key(f"slot_limit:{step}")

        retired = [self.key(f"{k}:{step - STEPS_KEPT}") for k in ("slots", "slot_limit")]

        async def fix() -> Any:
            if await self.redis.set(key, proposed, nx=True):
                await self.redis.delete(*retired)  # the step's first process drops old ones
            return await self.redis.get(key)

        return int(await self.retry.call("slot_limit", fix))

    async def slots_taken(self, step: int) -> int:
        key = self.key(f"slots:{step}")
        return int(await self.retry.call("slots_taken", lambda: self.redis.scard(key)))

    async def save_step(self, step: int) -> None:
        key = self.key("step")
        await self.retry.call("save_step", lambda: self.redis.set(key, step))
