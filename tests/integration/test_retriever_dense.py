"""The dense retriever as a real process: Search-R1 schema, exactness, batching, cache, gRPC."""

from __future__ import annotations

import asyncio
import json

import faiss
import grpc
import httpx
import numpy as np
import pytest

from harness import synthetic
from harness.retriever_server import RetrieverProcess
from protos import retriever_pb2, retriever_pb2_grpc
from retriever.client import RetrieverBadRequest, RetrieverClient, RetrieverUnavailable
from retriever.encoder import Encoder, EncoderSpec
from retriever.manifest import read_manifest
from searchr1.redis_server import free_port

ROWS = 150


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    return synthetic.dense_index(tmp_path_factory.mktemp("dense"), ROWS)


@pytest.fixture(scope="module")
def server(index_dir):
    cfg = {"limits": {"max_topk": 50, "max_queries": 8, "max_query_chars": 200}}
    with RetrieverProcess(index_dir, config=cfg) as rp:
        yield rp


@pytest.fixture(scope="module")
def brute(index_dir):
    """Exact search computed here: the same encoder settings, numpy over faiss's vectors."""
    m = read_manifest(index_dir).dense
    enc = Encoder(
        EncoderSpec(
            model_path=m.encoder_path,
            query_prefix=m.query_prefix,
            passage_prefix=m.passage_prefix,
            max_length=m.max_length,
        ),
        device="cpu",
    )
    index = faiss.read_index(str(index_dir / m.index_file))
    vecs = index.reconstruct_n(0, index.ntotal)

    def search(queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        scores = enc.encode(queries, is_query=True) @ vecs.T
        ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return ids, np.take_along_axis(scores, ids, 1)

    return search


def post(server, body) -> httpx.Response:
    return httpx.post(f"{server.url}/retrieve", json=body, timeout=30)


def corpus_row(index_dir, i: int) -> dict:
    with open(index_dir / "corpus.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[i]


QUERIES = synthetic.queries(4, corpus_rows=ROWS, seed=3)


@pytest.mark.parametrize("n_queries", [1, 2, 4])
def test_schema_without_scores_is_byte_for_byte_the_reference(server, index_dir, brute, n_queries):
    qs = QUERIES[:n_queries]
    r = post(server, {"queries": qs, "topk": 3, "return_scores": False})
    assert r.status_code == 200
    ids, _ = brute(qs, 3)
    expected = {"result": [[corpus_row(index_dir, int(i)) for i in row] for row in ids]}
    # FastAPI's serialization, as the reference server's: compact, UTF-8, key order kept.
    wire = json.dumps(expected, ensure_ascii=False, separators=(",", ":")).encode()
    assert r.content == wire


@pytest.mark.parametrize("n_queries", [1, 3])
def test_schema_with_scores(server, index_dir, brute, n_queries):
    qs = QUERIES[:n_queries]
    body = post(server, {"queries": qs, "topk": 5, "return_scores": True}).json()
    ids, scores = brute(qs, 5)
    assert list(body) == ["result"]
    assert len(body["result"]) == n_queries
    for per_query, id_row, score_row in zip(body["result"], ids, scores, strict=True):
        assert [list(item) for item in per_query] == [["document", "score"]] * 5
        assert [item["document"] for item in per_query] == [
            corpus_row(index_dir, int(i)) for i in id_row
        ]
        assert [item["score"] for item in per_query] == pytest.approx(score_row.tolist(), abs=1e-5)


def test_topk_null_and_zero_mean_three_and_results_are_exact(server, brute):
    qs = synthetic.queries(6, corpus_rows=ROWS, seed=11)
    for topk in (None, 0):
        body = post(server, {"queries": qs, "topk": topk}).json()
        ids, _ = brute(qs, 3)
        assert [[d["id"] for d in row] for row in body["result"]] == [
            [str(i) for i in row] for row in ids
        ]


async def test_64_concurrent_clients_each_get_their_own_answer(server, brute):
    qs = synthetic.queries(64, corpus_rows=ROWS, seed=5)
    ids, _ = brute(qs, 3)
    before = httpx.get(f"{server.url}/stats").json()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as c:
        resps = await asyncio.gather(
            *(c.post("/retrieve", json={"queries": [q], "topk": 3}) for q in qs)
        )
    after = httpx.get(f"{server.url}/stats").json()
    for resp, expected in zip(resps, ids, strict=True):
        assert [d["id"] for d in resp.json()["result"][0]] == [str(i) for i in expected]
    batches = after["batches"] - before["batches"]
    queries = after["batched_queries"] - before["batched_queries"]
    assert queries <= 64
    assert batches < queries  # queries of concurrent requests were searched together


def test_repeated_query_is_a_cache_hit(server):
    q = "cache me if you can"
    first = post(server, {"queries": [q], "topk": 4}).json()
    hits = httpx.get(f"{server.url}/stats").json()["cache"]["hits"]
    again = post(server, {"queries": ["  cache me   if you can "], "topk": 4}).json()
    assert again == first
    assert httpx.get(f"{server.url}/stats").json()["cache"]["hits"] == hits + 1
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "searchr1_retriever_cache_hit_ratio" in metrics
    assert 'searchr1_retriever_cache_lookups_total{result="hit"}' in metrics


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "queries: Field required"),
        ({"queries": []}, "non-empty list"),
        ({"queries": "one string"}, "queries: Input should be a valid list"),
        ({"queries": ["ok", 7]}, "queries.1: Input should be a valid string"),
        ({"queries": ["a"], "topk": -2}, "topk: must be >= 0"),
        ({"queries": ["a"], "topk": 51}, "topk: at most 50"),
        ({"queries": ["a"], "topk": "many"}, "topk"),
        ({"queries": ["a"] * 9}, "9 queries in one request, at most 8"),
        ({"queries": ["x" * 201]}, "queries.0: 201 characters, at most 200"),
    ],
)
def test_bad_input_is_422_with_a_clear_message(server, body, message):
    r = post(server, body)
    assert r.status_code == 422
    assert message in r.json()["error"]


async def test_a_lone_surrogate_query_is_422_and_its_neighbours_are_served(server):
    # JSON "\ud800" parses to a str the encoder's tokenizer cannot take (TypeError): it used to
    # be a 500 for the request and for every request batched with it.
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:

        async def post_escaped(queries: list[str]) -> httpx.Response:
            return await http.post(
                "/retrieve",
                content=json.dumps({"queries": queries}),  # escapes the surrogate
                headers={"content-type": "application/json"},
            )

        rs = await asyncio.gather(
            *(post_escaped([f"neighbour {i}"]) for i in range(8)), post_escaped(["ok", "who\ud800"])
        )
    assert [r.status_code for r in rs[:8]] == [200] * 8
    assert rs[8].status_code == 422, rs[8].text
    assert "queries.1: not valid Unicode" in rs[8].json()["error"]


def test_malformed_json_is_422(server):
    r = httpx.post(
        f"{server.url}/retrieve", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 422


async def test_grpc_and_http_agree(server):
    qs = QUERIES[:3]
    http_body = post(server, {"queries": qs, "topk": 4, "return_scores": True}).json()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
        stub = retriever_pb2_grpc.RetrieverStub(ch)
        resp = await stub.Search(retriever_pb2.SearchRequest(queries=qs, topk=4))
        default = await stub.Search(retriever_pb2.SearchRequest(queries=qs[:1]))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Search(retriever_pb2.SearchRequest(queries=[]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(default.results[0].documents) == 3
    for per_query, http_hits in zip(resp.results, http_body["result"], strict=True):
        assert [(d.document.id, d.document.contents) for d in per_query.documents] == [
            (h["document"]["id"], h["document"]["contents"]) for h in http_hits
        ]
        assert [d.score for d in per_query.documents] == pytest.approx(
            [h["score"] for h in http_hits], abs=1e-6
        )


async def test_client_contract(server, brute):
    client = RetrieverClient(server.url)
    try:
        assert await client.health() and await client.ready()
        hits = await client.search(QUERIES[:2], topk=2)
        ids, scores = brute(QUERIES[:2], 2)
        assert [[h.id for h in row] for row in hits] == [[str(i) for i in r] for r in ids]
        assert hits[0][0].score == pytest.approx(float(scores[0][0]), abs=1e-5)
        assert hits[0][0].contents.startswith('"')
        with pytest.raises(RetrieverBadRequest, match="422"):
            await client.search([], topk=2)
    finally:
        await client.aclose()
    dead = RetrieverClient(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    try:
        assert not await dead.health() and not await dead.ready()
        with pytest.raises(RetrieverUnavailable):
            await dead.search(["q"])
    finally:
        await dead.aclose()


def test_health_ready_metrics(server):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    ready = httpx.get(f"{server.url}/ready").json()
    assert ready["ready"] and ready["checks"]["index"]["detail"] == "dense"
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "searchr1_http_request_duration_seconds_bucket",
        "searchr1_retriever_batch_queries_bucket",
        "searchr1_retriever_queries_total",
        "searchr1_retriever_errors_total",
    ):
        assert name in text
