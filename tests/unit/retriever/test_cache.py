from __future__ import annotations

from retriever.cache import ResultCache, normalize_query


def hit(i: int):
    return [({"id": str(i), "contents": "c"}, 1.0)]


def test_normalize_collapses_white_space_and_keeps_case():
    assert normalize_query("  Who  founded\tRome \n") == "Who founded Rome"


def test_lru_evicts_least_recently_used_and_counts_hits():
    c = ResultCache(2)
    c.put("a", 3, hit(1))
    c.put("b", 3, hit(2))
    assert c.get("a", 3) == hit(1)  # a is now the most recent
    c.put("c", 3, hit(3))  # evicts b
    assert c.get("b", 3) is None
    assert c.get("c", 3) == hit(3)
    assert c.get("a", 5) is None  # topk is part of the key
    assert (c.hits, c.misses, len(c)) == (2, 2, 2)


def test_size_zero_disables():
    c = ResultCache(0)
    c.put("a", 3, hit(1))
    assert c.get("a", 3) is None
    assert len(c) == 0
