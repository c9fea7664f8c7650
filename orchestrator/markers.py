"""A run's markers in Redis: what lets a restarted orchestrator continue its run.

Keys under the run's prefix (`searchr1:orchestrator:<run.id>`):

    base_version  the engine's weight version when the run first started (set once)
    step          the next step to roll out
    published     the ids of the groups already on the bus (a set)
    record        what makes the run this run (`run_record`): data, seed, batch sizes

Every call is retried while Redis is down (`RedisRetry`): a blip must not kill the process with
every in-flight sample. All of them are idempotent, so a retry is harmless.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.config import OrchestratorConfig
from searchr1.redis_retry import RedisRetry
from searchr1.sections import RunConfig

_KEYS = ("base_version", "step", "published", "record")


class RunIdInUse(RuntimeError):
    """`run.id` names a run in Redis that this one must not silently continue."""


def run_record(cfg: OrchestratorConfig, run: RunConfig) -> dict[str, Any]:
    """What makes a run this run: a restart with the same values continues it."""
    d = cfg.data
    return {
        "train_path": d.train_path,
        "max_prompts": d.max_prompts,
        "seed": d.seed,
        "shuffle": d.shuffle,
        "epochs": cfg.epochs,
        "groups_per_step": run.groups_per_step,
        "group_size": run.group_size,
    }


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
        raise RunIdInUse(
            f"run.id {run_id!r} has already rolled out all its {step} steps "
            f"(a new run reusing the id would publish nothing): {how}"
        )


class RunMarkers:
    """The markers of one run id, read and written through `retry`."""

    def __init__(self, redis: Any, prefix: str, retry: RedisRetry) -> None:
        self.redis = redis
        self.prefix = prefix
        self.retry = retry

    def key(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    async def forget(self) -> None:
        """Delete the markers (`--fresh`): the next start is a new run."""
        keys = [self.key(k) for k in _KEYS]
        await self.retry.call("forget", lambda: self.redis.delete(*keys))

    async def restore(self, version: int, record: dict[str, Any]) -> tuple[int, int, Any]:
        """(base version, next step, the stored record). On the run's first start the base
        version becomes `version` and the stored record `record`."""
        r = self.redis
        text = json.dumps(record, sort_keys=True)

        async def read() -> tuple[Any, Any, Any]:
            await r.set(self.key("base_version"), version, nx=True)
            await r.set(self.key("record"), text, nx=True)
            return (
                await r.get(self.key("base_version")),
                await r.get(self.key("step")),
                await r.get(self.key("record")),
            )

        base, step, stored = await self.retry.call("restore", read)
        return int(base), int(step or 0), stored

    async def published(self, group_id: str) -> bool:
        key = self.key("published")
        return bool(await self.retry.call("published", lambda: self.redis.sismember(key, group_id)))

    async def mark_published(self, group_id: str) -> None:
        key = self.key("published")
        await self.retry.call("mark_published", lambda: self.redis.sadd(key, group_id))

    async def published_count(self) -> int:
        key = self.key("published")
        return int(await self.retry.call("published_count", lambda: self.redis.scard(key)))

    async def save_step(self, step: int) -> None:
        key = self.key("step")
        await self.retry.call("save_step", lambda: self.redis.set(key, step))
