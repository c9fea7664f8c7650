"""The prefix cache on its own (no model): match, insert, splits, budget, LRU, locks, flush."""

from __future__ import annotations

import pytest
import torch

from inference.prefix_cache import KVRow, PrefixCache

LAYERS, HEADS, DIM = 2, 2, 3


def kv_for(ids: list[int], start: int = 0) -> KVRow:
    """Fake K/V whose entries say which token (k) at which position (v) made them, per layer."""
    n = len(ids)
    tok = torch.tensor(ids, dtype=torch.float32)[None, :, None].expand(HEADS, n, DIM)
    pos = torch.arange(start, start + n, dtype=torch.float32)[None, :, None].expand(HEADS, n, DIM)
    return [(tok + 1000 * layer, pos + 1000 * layer) for layer in range(LAYERS)]


def assert_kv(kv: KVRow | None, ids: list[int]) -> None:
    assert kv is not None
    want = kv_for(ids)
    assert len(kv) == LAYERS
    for (k, v), (wk, wv) in zip(kv, want, strict=True):
        assert torch.equal(k, wk) and torch.equal(v, wv)


def test_empty_cache_matches_nothing() -> None:
    cache = PrefixCache(100)
    assert cache.match([1, 2, 3]) == (0, None)
    assert cache.stats.tokens == 0


def test_match_returns_the_longest_cached_prefix_and_its_kv() -> None:
    cache = PrefixCache(100)
    assert cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4])) == 4
    n, kv = cache.match([1, 2, 3, 4, 5, 6])
    assert n == 4
    assert_kv(kv, [1, 2, 3, 4])
    n, kv = cache.match([1, 2, 9])  # ends inside a node: a slice of it
    assert n == 2
    assert_kv(kv, [1, 2])
    assert cache.match([7, 1, 2]) == (0, None)
    assert cache.match([]) == (0, None)


def test_branching_inserts_split_nodes_and_store_each_token_once() -> None:
    cache = PrefixCache(100)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    assert cache.insert([1, 2, 5, 6, 7], kv_for([1, 2, 5, 6, 7])) == 3
    assert cache.stats.tokens == 7
    assert cache.stats.nodes == 3  # [1, 2] -> {[3, 4], [5, 6, 7]}
    for ids in ([1, 2, 3, 4], [1, 2, 5, 6, 7]):
        n, kv = cache.match(ids)
        assert n == len(ids)
        assert_kv(kv, ids)
    assert cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4])) == 0  # already there
    assert cache.insert([1, 2], kv_for([1, 2])) == 0  # a prefix of what is there
    assert cache.stats.tokens == 7


def test_insert_copies_the_kv_it_keeps() -> None:
    # The engine inserts slices of its batch tensors: the cache must not keep (or see changes
    # to) the whole batch.
    cache = PrefixCache(100)
    kv = kv_for([1, 2, 3])
    cache.insert([1, 2, 3], kv)
    kv[0][0].add_(5)
    _, got = cache.match([1, 2, 3])
    assert_kv(got, [1, 2, 3])


def test_kv_and_ids_must_agree() -> None:
    cache = PrefixCache(100)
    with pytest.raises(AssertionError):
        cache.insert([1, 2, 3], kv_for([1, 2]))


def test_budget_evicts_the_least_recently_used_leaf() -> None:
    cache = PrefixCache(8)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    cache.insert([5, 6, 7, 8], kv_for([5, 6, 7, 8]))
    cache.match([1, 2, 3, 4])  # [1..4] is now more recent than [5..8]
    assert cache.insert([9, 10, 11, 12], kv_for([9, 10, 11, 12])) == 4
    assert cache.stats.tokens == 8
    assert cache.stats.evicted_tokens == 4
    assert cache.match([5, 6, 7, 8])[0] == 0
    assert cache.match([1, 2, 3, 4])[0] == 4
    assert cache.match([9, 10, 11, 12])[0] == 4


def test_eviction_takes_leaves_before_the_prefix_they_share() -> None:
    cache = PrefixCache(6)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    cache.insert([1, 2, 5, 6], kv_for([1, 2, 5, 6]))  # [1, 2] shared: 6 tokens
    cache.match([1, 2, 5, 6])
    cache.insert([7, 8], kv_for([7, 8]))  # room for 2: the older leaf [3, 4] goes
    assert cache.match([1, 2, 3, 4])[0] == 2
    assert cache.match([1, 2, 5, 6])[0] == 4
    assert cache.match([7, 8])[0] == 2
    # A parent left without children becomes a leaf, and can go in turn.
    cache.insert([9, 10, 11, 12], kv_for([9, 10, 11, 12]))
    assert cache.stats.tokens <= 6
    assert cache.match([9, 10, 11, 12])[0] == 4


def test_a_sequence_longer_than_the_budget_keeps_its_first_tokens() -> None:
    cache = PrefixCache(4)
    assert cache.insert([1, 2, 3, 4, 5, 6], kv_for([1, 2, 3, 4, 5, 6])) == 4
    n, kv = cache.match([1, 2, 3, 4, 5, 6])
    assert n == 4
    assert_kv(kv, [1, 2, 3, 4])


def test_extending_a_cached_path_never_evicts_that_path() -> None:
    cache = PrefixCache(6)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    cache.insert([9, 9], kv_for([9, 9]))
    cache.match([9, 9])  # [1..4] is the LRU leaf, but it is the path being extended
    assert cache.insert([1, 2, 3, 4, 5, 6], kv_for([1, 2, 3, 4, 5, 6])) == 2
    assert cache.match([1, 2, 3, 4, 5, 6])[0] == 6
    assert cache.match([9, 9])[0] == 0


def test_locked_prefixes_are_not_evicted_and_the_budget_still_holds() -> None:
    cache = PrefixCache(8)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    lease = cache.lock([1, 2, 3, 4, 99])
    assert cache.stats.locked_tokens == 4
    cache.insert([5, 6, 7, 8], kv_for([5, 6, 7, 8]))
    # Full; only [5..8] can go, although [1..4] is older.
    assert cache.insert([9, 10, 11, 12, 13, 14], kv_for([9, 10, 11, 12, 13, 14])) == 4
    assert cache.match([1, 2, 3, 4])[0] == 4
    assert cache.stats.tokens == 8
    cache.lock([9, 10, 11, 12])
    assert cache.insert([20, 21], kv_for([20, 21])) == 0  # everything locked: nothing stored
    assert cache.stats.tokens == 8
    cache.unlock(lease)
    cache.unlock(lease)  # twice is harmless
    assert cache.stats.locked_tokens == 4
    assert cache.insert([20, 21], kv_for([20, 21])) == 2
    assert cache.match([1, 2, 3, 4])[0] == 0  # evicted whole: the oldest unlocked leaf
    assert cache.stats.tokens <= 8


def test_a_split_keeps_the_lock_on_both_halves() -> None:
    cache = PrefixCache(6)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    lease = cache.lock([1, 2, 3, 4])
    cache.insert([1, 2, 7], kv_for([1, 2, 7]))  # splits the locked node at 2
    assert cache.stats.locked_tokens == 4
    assert cache.insert([8, 8, 8], kv_for([8, 8, 8])) == 2  # only [7] could go: room for 2
    assert cache.match([1, 2, 3, 4])[0] == 4
    cache.unlock(lease)
    assert cache.stats.locked_tokens == 0
    assert cache.insert([5, 5, 5, 5, 5], kv_for([5, 5, 5, 5, 5])) == 5
    assert cache.stats.tokens <= 6


def test_lock_on_nothing_cached_is_a_no_op() -> None:
    cache = PrefixCache(4)
    lease = cache.lock([1, 2])
    assert cache.stats.locked_tokens == 0
    cache.unlock(lease)
    assert cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4])) == 4


def test_flush_drops_everything_and_outstanding_locks() -> None:
    cache = PrefixCache(8)
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    lease = cache.lock([1, 2, 3, 4])
    generation = cache.generation
    cache.flush()
    assert cache.generation == generation + 1
    assert cache.match([1, 2, 3, 4]) == (0, None)
    assert cache.stats.tokens == 0 and cache.stats.locked_tokens == 0
    assert cache.stats.flushes == 1
    cache.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    cache.unlock(lease)  # a lease from before the flush does not touch the new tree
    new = cache.lock([1, 2, 3, 4])
    assert cache.stats.locked_tokens == 4
    cache.unlock(new)
    assert cache.stats.locked_tokens == 0


def test_stats_count_lookups_and_hits() -> None:
    cache = PrefixCache(100)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    cache.match([1, 2, 3, 4])
    cache.match([5])
    s = cache.stats
    assert (s.lookups, s.lookup_tokens, s.hit_tokens, s.inserted_tokens) == (2, 5, 3, 3)
    assert s.budget == 100


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(0)
