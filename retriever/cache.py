"""LRU cache of search results keyed by (normalized query, topk).

Only touched from the event loop thread, so it needs no lock. Rollouts repeat queries a lot
(the same question sampled n times per group), so hits are common during RL. Bounded twice:
by entries (`cache.size`) and by the estimated bytes they hold (`cache.max_bytes`), since one
entry is topk passages of any length.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

from prometheus_client import Counter, Gauge

from retriever.backends.base import Hit

CACHE_LOOKUPS = Counter(
    "searchr1_retriever_cache_lookups_total", "Result-cache lookups", ["result"]
)
CACHE_HIT_RATIO = Gauge(
    "searchr1_retriever_cache_hit_ratio", "Result-cache hits / lookups since start"
)


def normalize_query(q: str) -> str:
    """The cache key and the text searched: surrounding and repeated white space dropped.

    Case is kept: a cased encoder may rank differently for different case.
    """
    return " ".join(q.split())


# Python's own cost beyond the strings, measured with tracemalloc on CPython 3.11: ~200 bytes
# an entry (key tuple, list, OrderedDict node), ~380 a hit (its tuple, dict and float).
ENTRY_OVERHEAD = 200
HIT_OVERHEAD = 384


def entry_bytes(query: str, hits: list[Hit]) -> int:
    """The memory an entry holds, estimated (within ~10% of tracemalloc for corpus rows)."""
    n = ENTRY_OVERHEAD + sys.getsizeof(query)
    for doc, _ in hits:
        n += HIT_OVERHEAD + sum(sys.getsizeof(v) for v in doc.values())
    return n


class ResultCache:
    def __init__(self, size: int, *, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self._data: OrderedDict[tuple[str, int], tuple[list[Hit], int]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, query: str, topk: int) -> list[Hit] | None:
        if self.size == 0:
            return None
        key = (query, topk)
        entry = self._data.get(key)
        if entry is None:
            self.misses += 1
            CACHE_LOOKUPS.labels("miss").inc()
        else:
            self._data.move_to_end(key)
            self.hits += 1
            CACHE_LOOKUPS.labels("hit").inc()
        CACHE_HIT_RATIO.set(self.hits / (self.hits + self.misses))
        return None if entry is None else entry[0]

    def put(self, query: str, topk: int, hits: list[Hit]) -> None:
        if self.size == 0:
            return
        key = (query, topk)
        old = self._data.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        n = entry_bytes(query, hits)
        if n > self.max_bytes:  # would evict everything else and still not fit
            return
        self._data[key] = (hits, n)
        self.bytes += n
        while len(self._data) > self.size or self.bytes > self.max_bytes:
            _, (_, gone) = self._data.popitem(last=False)
            self.bytes -= gone

    def clear(self) -> None:
        self._data.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._data)
