"""The web backend served as a process against a local fake serper.dev."""

from __future__ import annotations

import httpx
import pytest

from harness.retriever_server import FakeSerper, RetrieverProcess
from retriever.client import RetrieverClient, RetrieverUnavailable


@pytest.fixture(scope="module")
def fake():
    with FakeSerper(api_key="secret-key") as f:
        yield f


@pytest.fixture(scope="module")
def server(fake):
    env = {
        "SERPER_API_KEY": "secret-key",
        "SEARCHR1_RETRIEVER__SERPER__URL": fake.url,
        "SEARCHR1_RETRIEVER__SERPER__BACKOFF_S": "0.01",
        "SEARCHR1_RETRIEVER__SERPER__MAX_RETRIES": "1",
    }
    with RetrieverProcess(None, web=True, grpc=False, env=env) as rp:
        yield rp


def test_web_results_in_the_search_r1_schema(server, fake):
    r = httpx.post(f"{server.url}/retrieve", json={"queries": ["capital of france"], "topk": 2})
    assert r.status_code == 200
    assert r.json() == {
        "result": [
            [
                {
                    "id": "https://example.org/1?q=capital+of+france",
                    "contents": '"capital of france title 1"\nsnippet 1 about capital of france',
                },
                {
                    "id": "https://example.org/2?q=capital+of+france",
                    "contents": '"capital of france title 2"\nsnippet 2 about capital of france',
                },
            ]
        ]
    }
    assert fake.bodies[-1] == {"q": "capital of france", "num": 2, "gl": "us", "hl": "en"}
    assert httpx.get(f"{server.url}/ready").json()["checks"]["index"]["detail"] == "web"


def test_a_lone_surrogate_query_is_422_not_sent_to_serper(server, fake):
    # httpx cannot encode "\ud800" as UTF-8 (UnicodeEncodeError): it used to be a 500.
    sent = len(fake.bodies)
    r = httpx.post(
        f"{server.url}/retrieve",
        content=b'{"queries": ["who\\ud800"]}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 422, r.text
    assert "queries.0: not valid Unicode" in r.json()["error"]
    assert len(fake.bodies) == sent


async def test_serper_outage_is_a_visible_503_not_an_empty_result(server, fake):
    fake.fail_with[:] = [500, 500]
    client = RetrieverClient(server.url)
    try:
        with pytest.raises(RetrieverUnavailable, match="503"):
            await client.search(["outage query"])
        # The failure was not cached: the next call reaches serper again and succeeds.
        hits = await client.search(["outage query"])
    finally:
        await client.aclose()
    assert [h.score for h in hits[0]] == [1.0, 0.5, pytest.approx(1 / 3)]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'searchr1_retriever_errors_total{kind="unavailable",protocol="http"} 1.0' in metrics


def test_sigterm_shuts_down_cleanly_with_status_0(fake):
    rp = RetrieverProcess(None, web=True, env={"SERPER_API_KEY": "k"}).start()
    assert rp.stop() == 0


def test_missing_serper_key_fails_fast_with_status_1(fake, monkeypatch):
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    rp = RetrieverProcess(None, web=True, grpc=False, ready_timeout_s=60)
    with pytest.raises(RuntimeError, match="exited with status 1"):
        rp.start()
    rp.stop()


def test_a_client_that_goes_away_cancels_its_web_searches(fake):
    """The server cancels the handler of a request whose client disconnected, so its queries
    stop waiting for the rate limiter and are never sent (each costs API credit)."""
    env = {
        "SERPER_API_KEY": "secret-key",
        "SEARCHR1_RETRIEVER__SERPER__URL": fake.url,
        "SEARCHR1_RETRIEVER__SERPER__RATE_LIMIT_QPS": "4",
    }
    with RetrieverProcess(None, web=True, grpc=False, env=env) as rp:
        before = len(fake.bodies)
        queries = [f"abandoned {i}" for i in range(12)]  # 3 s at 4/s
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{rp.url}/retrieve", json={"queries": queries, "topk": 1}, timeout=0.5)
        import time

        time.sleep(2.5)
        sent = len(fake.bodies) - before
        assert sent < 8, sent
        metrics = httpx.get(f"{rp.url}/metrics").text
        assert "searchr1_retriever_client_disconnects_total 1.0" in metrics
