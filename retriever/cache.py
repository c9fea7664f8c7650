"""LRU cache of search results keyed by (normalized query, topk).

Only touched from the event loop thread, so it needs no lock. Rollouts repeat queries a lot
(the same question sampled n times per group), so hits are common during RL.
"""

from __future__ import annotations

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


class ResultCache:
    def __init__(self, size: int) -> None:
        self.size = size
        self._data: OrderedDict[tuple[str, int], list[Hit]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, query: str, topk: int) -> list[Hit] | None:
        if self.size == 0:
            return None
        key = (query, topk)
        value = self._data.get(key)
        if value is None:
            self.misses += 1
            CACHE_LOOKUPS.labels("miss").inc()
        else:
            self._data.move_to_end(key)
            self.hits += 1
            CACHE_LOOKUPS.labels("hit").inc()
        CACHE_HIT_RATIO.set(self.hits / (self.hits + self.misses))
        return value

    def put(self, query: str, topk: int, hits: list[Hit]) -> None:
        if self.size == 0:
            return
        self._data[(query, topk)] = hits
        self._data.move_to_end((query, topk))
        while len(self._data) > self.size:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
