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


def doc_hits(i: int, chars: int, k: int = 3):
    return [({"id": f"{i}-{r}", "contents": "x" * chars}, 1.0) for r in range(k)]


def test_memory_is_bounded_in_bytes_evicting_least_recently_used():
    c = ResultCache(size=1000, max_bytes=20_000)
    for i in range(3):
        c.put(f"q{i}", 3, doc_hits(i, 1000))
    assert len(c) == 3 and 9_000 < c.bytes <= 20_000
    c.get("q0", 3)  # q0 is now the most recent
    for i in range(3, 6):
        c.put(f"q{i}", 3, doc_hits(i, 1000))
    assert c.bytes <= 20_000
    assert c.get("q1", 3) is None and c.get("q2", 3) is None  # the least recently used went
    assert c.get("q0", 3) is not None and c.get("q5", 3) is not None


def test_big_results_count_by_their_size_not_as_one_entry():
    # 100 KB a result: an entry bound of 100,000 would hold 10 GB; the byte bound holds 1 MB.
    c = ResultCache(size=100_000, max_bytes=1_000_000)
    for i in range(100):
        c.put(f"q{i}", 3, doc_hits(i, 100_000 // 3))
    assert c.bytes <= 1_000_000
    assert 5 <= len(c) <= 10


def test_an_entry_larger_than_the_bound_is_not_cached():
    c = ResultCache(size=10, max_bytes=5_000)
    c.put("small", 3, doc_hits(0, 100))
    c.put("huge", 3, doc_hits(1, 10_000))
    assert c.get("huge", 3) is None and c.get("small", 3) is not None


def test_clear_resets_the_byte_count():
    c = ResultCache(size=10, max_bytes=100_000)
    c.put("a", 3, doc_hits(0, 100))
    c.clear()
    assert c.bytes == 0 and len(c) == 0


def test_the_byte_bound_is_configured():
    from retriever.config import CacheConfig

    assert CacheConfig().max_bytes == 256 * 1024 * 1024
