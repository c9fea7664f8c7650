"""BM25 served as a process, and hybrid (dense + BM25, RRF) through the engine in-process."""

from __future__ import annotations

import bm25s
import httpx
import pytest
import Stemmer

from harness import synthetic
from harness.retriever_server import RetrieverProcess
from retriever.build import build_index
from retriever.config import BuildConfig, RetrieverConfig
from retriever.engine import RetrieverEngine

ROWS = 200


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("bm25")
    return synthetic.write_corpus(d / "corpus.jsonl", ROWS, seed=2, words=25)


@pytest.fixture(scope="module")
def rows():
    return list(synthetic.passages(ROWS, seed=2, words=25))


@pytest.fixture(scope="module")
def bm25_dir(corpus):
    out = corpus.parent / "bm25-index"
    build_index(corpus, out, BuildConfig(backend="bm25", progress=False))
    return out


def test_bm25_server_matches_bm25s_directly(bm25_dir, rows):
    # Expected: bm25s over the same texts with the same settings, computed here.
    stem = Stemmer.Stemmer("english")
    model = bm25s.BM25(k1=0.9, b=0.4, method="lucene")
    model.index(
        bm25s.tokenize(
            [r["contents"] for r in rows], stopwords="en", stemmer=stem, show_progress=False
        ),
        show_progress=False,
    )
    title = rows[17]["contents"].split("\n")[0].strip('"')
    qs = [f"who founded {title}", "castle harbor library"]
    q_tokens = bm25s.tokenize(
        qs, stopwords="en", stemmer=stem, return_ids=False, show_progress=False
    )
    ids, scores = model.retrieve(q_tokens, k=4, show_progress=False)
    with RetrieverProcess(bm25_dir, grpc=False) as rp:
        body = httpx.post(
            f"{rp.url}/retrieve", json={"queries": qs, "topk": 4, "return_scores": True}, timeout=30
        ).json()
        nothing = httpx.post(f"{rp.url}/retrieve", json={"queries": ["zzzqqq"]}, timeout=30)
    assert body["result"][0][0]["document"] == rows[17]
    for got, id_row, score_row in zip(body["result"], ids, scores, strict=True):
        assert [h["document"]["id"] for h in got] == [str(i) for i in id_row]
        assert [h["score"] for h in got] == pytest.approx(score_row.tolist(), rel=1e-5)
    # No query term in the corpus: no hits (like Lucene), not random zero-score rows.
    assert nothing.json() == {"result": [[]]}


@pytest.mark.slow  # over 10 s: CI's slow phase (issue 45)
async def test_hybrid_fuses_dense_and_bm25(corpus, rows):
    out = corpus.parent / "hybrid-index"
    build_index(corpus, out, BuildConfig(backend="hybrid", max_length=48, progress=False))
    engine = await RetrieverEngine.load(RetrieverConfig(index_dir=str(out)))
    try:
        assert engine.backend.name == "hybrid"
        title = rows[42]["contents"].split("\n")[0].strip('"')
        res = await engine.search([f"{title} history"], 5)
        _, dense_ids = engine.backend.dense.search_ids([f"{title} history"], 20)
        _, bm25_ids = engine.backend.bm25.search_ids([f"{title} history"], 20)
    finally:
        await engine.aclose()
    assert res[0][0][0] == rows[42]
    # Every fused hit came from one of the two candidate lists, with an RRF score.
    candidates = set(dense_ids[0].tolist()) | set(bm25_ids[0].tolist())
    assert all(int(doc["id"]) in candidates for doc, _ in res[0])

    def rrf(i: int) -> float:
        ranks = [list(ids[0]).index(i) + 1 for ids in (dense_ids, bm25_ids) if i in ids[0]]
        return sum(1 / (60 + r) for r in ranks)

    assert [s for _, s in res[0]] == pytest.approx([rrf(int(d["id"])) for d, _ in res[0]])
    assert rrf(42) > 1 / 61  # found by both backends
