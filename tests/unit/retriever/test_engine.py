from __future__ import annotations

import pytest

from retriever.config import LimitsConfig, RetrieverConfig
from retriever.engine import BadRequest, RetrieverEngine
from retriever.server import format_results


class EchoBackend:
    name = "echo"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def search_batch(self, queries, topk):
        self.calls.append(list(queries))
        return [
            [({"id": q, "contents": f'"{q}"\nbody'}, 1.0 / (r + 1)) for r in range(topk)]
            for q in queries
        ]

    def close(self) -> None:
        pass


@pytest.fixture
async def engine():
    cfg = RetrieverConfig(limits=LimitsConfig(max_topk=5, max_queries=3, max_query_chars=10))
    eng = RetrieverEngine(EchoBackend(), cfg)
    yield eng
    await eng.aclose()


@pytest.mark.parametrize(
    ("queries", "topk", "message"),
    [
        ([], None, "queries: must be a non-empty list"),
        (["a", "b", "c", "d"], None, "4 queries in one request, at most 3"),
        (["a", 3], None, "queries.1: must be a string"),
        (["x" * 11], None, "queries.0: 11 characters, at most 10"),
        (["a"], -1, "topk: must be >= 0"),
        (["a"], 6, "topk: at most 5, got 6"),
        (["ok", "who\ud800"], None, "queries.1: not valid Unicode"),
    ],
)
async def test_bad_requests_name_the_field(engine, queries, topk, message):
    with pytest.raises(BadRequest, match=message):
        await engine.search(queries, topk)


async def test_default_topk_and_dedup_and_cache(engine):
    res = await engine.search(["a", " a ", "b"], 0)
    assert [len(h) for h in res] == [3, 3, 3]  # 0 means the default, 3
    assert engine.backend.calls == [["a", "b"]]  # normalized duplicates searched once
    res2 = await engine.search(["b"], None)
    assert res2[0] == res[2]
    assert engine.backend.calls == [["a", "b"]]  # served from the cache
    assert engine.cache.hits >= 1


def test_format_results_both_modes():
    hits = [[({"id": "1", "contents": "c"}, 0.5)]]
    assert format_results(hits, False) == [[{"id": "1", "contents": "c"}]]
    doc = {"id": "1", "contents": "c"}
    assert format_results(hits, True) == [[{"document": doc, "score": 0.5}]]
