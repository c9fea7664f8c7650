"""Which waiting requests one prefill pass admits, and what the prefix cache keeps of them.

Used by the engine's scheduler thread only (no locking here). A left-padded prefill computes
every row as long as the batch's longest uncached tail (`inference.batch.prefill`), so:
- cache hits and misses are admitted in separate passes: a hit beside a cold prompt would be
  recomputed;
- a request that starts like one already chosen for the pass (a GRPO group arriving at once)
  waits one step, and then finds that start in the cache, inserted at admission (SGLang's
  in-batch prefix check does the same).
Held requests go back to the front of the queue: the next pass starts with them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from inference.batch import KV
from inference.prefix_cache import KVRow, PrefixCache
from inference.requests import Request

# Fewer shared or cached leading tokens than this are not worth a step's wait.
SHARED_MIN = 32


def choose(waiting: deque[Request], limit: int, cache: PrefixCache | None) -> list[Request]:
    """Pop the requests of the next prefill pass (at most `limit`) off `waiting`."""
    batch: list[Request] = []
    held: list[Request] = []
    warm_pass: bool | None = None  # this pass admits cache hits, or misses
    while waiting and len(batch) < limit:
        req = waiting.popleft()
        if req.cancelled:
            continue
        warm = is_warm(req, cache)
        if warm_pass is None:
            warm_pass = warm
        # A cold request's start is not cached (is_warm walked the tree for it already).
        if warm != warm_pass or (cache is not None and not warm and starts_like(req, batch)):
            held.append(req)
        else:
            batch.append(req)
    waiting.extendleft(reversed(held))
    return batch


def is_warm(req: Request, cache: PrefixCache | None) -> bool:
    """Whether the cache holds a useful prefix of `req`'s prompt (cache off: never)."""
    if cache is None or req.output_ids:
        return False
    return cache.cached_length(req.input_ids[:-1]) >= SHARED_MIN


def starts_like(req: Request, batch: list[Request]) -> bool:
    """Whether `req`'s prompt starts (SHARED_MIN tokens) like one already in `batch`."""
    if req.output_ids or len(req.input_ids) <= SHARED_MIN:
        return False
    head = req.input_ids[:SHARED_MIN]
    return any(not other.output_ids and other.input_ids[:SHARED_MIN] == head for other in batch)


def keep_admitted(
    cache: PrefixCache,
    reqs: list[Request],
    seqs: list[list[int]],
    kv: KV,
    pads: list[int],
    used: list[int],
) -> None:
    """After a prefill pass (its requests already in the running batch, whose clearing gives
    every lock back): store each sequence's K/V and lock it while the request runs."""
    for i, req in enumerate(reqs):
        if not req.output_ids:  # its prompt's first admission (not a re-admission)
            req.cached_tokens = used[i]
        cache.insert(seqs[i], [(k[i, :, pads[i] :], v[i, :, pads[i] :]) for k, v in kv])
        req.cache_lease = cache.lock(seqs[i])
        req.cache_generation = cache.generation


def release(
    cache: PrefixCache, req: Request, finished_kv: Callable[[], KVRow] | None = None
) -> None:
    """A request leaves the batch: unlock its prefix. When it finished (`finished_kv` gives its
    prompt + output but the last sampled token), store that first, so that the next turn of
    its conversation finds it; not across a flush (its K/V is of older weights)."""
    if finished_kv is not None and req.cache_generation == cache.generation:
        kv = finished_kv()
        cache.insert((req.input_ids + req.output_ids)[: kv[0][0].shape[1]], kv)
    if req.cache_lease is not None:
        cache.unlock(req.cache_lease)
        req.cache_lease = None
