"""EnginePool: affinity by routing key, least-loaded assignment, failover, spill, versions."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from engine_client.client import GenerateResult, InferenceClient, InferenceUnavailable
from engine_client.pool import FROZEN, EnginePool


def result(engine: str) -> GenerateResult:
    return GenerateResult(
        text=engine, output_ids=[1], logprobs=None, finish_reason="stop", matched_stop=None,
        prompt_tokens=1, completion_tokens=1, weight_version=0, start_weight_version=0,
    )  # fmt: skip


class FakeEngine:
    """Stands in for one InferenceClient: answers with its URL, or fails while `down`; a call
    can be held open (`hold`) so that it counts as in flight."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.down = False
        self.version = 0
        self.calls: list[dict[str, Any]] = []
        self.hold: asyncio.Event | None = None
        self.vocab_size: int | None = None
        self.thawed = asyncio.Event()  # cleared: frozen (SIGSTOP): nothing answers
        self.thawed.set()

    async def generate(self, input_ids: list[int], **kwargs: Any) -> GenerateResult:
        self.calls.append(kwargs)
        await self.thawed.wait()
        if self.hold is not None:
            await self.hold.wait()
        if self.down:
            raise InferenceUnavailable(f"{self.url} is down")
        return result(self.url)

    async def health(self, deadline_s: float) -> bool:
        try:
            await asyncio.wait_for(self.thawed.wait(), deadline_s)
        except TimeoutError:
            return False
        return True

    async def get_model_info(self) -> dict[str, Any]:
        await self.thawed.wait()
        if self.down:
            raise InferenceUnavailable(f"{self.url} is down")
        return {"model_path": "m", "weight_version": self.version}

    async def aclose(self) -> None:
        pass


def pool(n: int = 2, **kwargs: Any) -> tuple[EnginePool, dict[str, FakeEngine]]:
    fakes = {f"http://e{i}": FakeEngine(f"http://e{i}") for i in range(n)}
    return EnginePool(list(fakes), lambda url: fakes[url], **kwargs), fakes  # type: ignore[arg-type, return-value]


async def test_the_calls_of_one_key_stay_on_one_engine_and_new_keys_spread() -> None:
    p, _ = pool(2)
    firsts = {key: (await p.generate([1], routing_key=key)).text for key in "abcd"}
    assert sorted(firsts.values()) == ["http://e0", "http://e0", "http://e1", "http://e1"]
    for _ in range(3):
        for key, engine in firsts.items():
            assert (await p.generate([1, 2], routing_key=key)).text == engine
    assert [e.keys for e in p.engines] == [2, 2]


async def test_a_new_key_goes_to_the_engine_with_fewest_calls_in_flight() -> None:
    p, fakes = pool(2)
    fakes["http://e0"].hold = asyncio.Event()
    busy = [asyncio.create_task(p.generate([1], routing_key="a"))]  # lands on e0 and waits
    await asyncio.sleep(0)
    assert p.engines[0].in_flight == 1
    for key in "bcd":  # e0 is busy: every new key goes to e1 ... until e1 is as busy
        engine, how = p.route(key)
        assert (engine.url, how) == ("http://e1", "assigned")
    fakes["http://e0"].hold.set()
    await asyncio.gather(*busy)
    assert p.engines[0].in_flight == 0


async def test_the_routing_key_reaches_the_engine_client() -> None:
    p, fakes = pool(1)
    await p.generate([1], routing_key="group-7", max_new_tokens=3)
    assert fakes["http://e0"].calls == [{"routing_key": "group-7", "max_new_tokens": 3}]


async def test_a_down_engine_hands_its_keys_to_another_where_they_stay() -> None:
    p, fakes = pool(2, retry_down_s=0.05)
    home = (await p.generate([1], routing_key="k")).text
    other = next(url for url in fakes if url != home)
    fakes[home].down = True
    with pytest.raises(InferenceUnavailable):
        await p.generate([1], routing_key="k")  # the caller retries ...
    assert (await p.generate([1], routing_key="k")).text == other  # ... on the other engine
    fakes[home].down = False
    await asyncio.sleep(0.06)  # the old engine is up again: the key stays where its cache is
    assert p.route("k") == (p.engines[list(fakes).index(other)], "sticky")
    assert [e.keys for e in p.engines] == [1 if e.url == other else 0 for e in p.engines]


async def test_with_every_engine_down_a_key_still_tries_its_own() -> None:
    p, _ = pool(2, retry_down_s=60)
    await p.generate([1], routing_key="k")
    for engine in p.engines:
        p.mark_down(engine)
    engine, how = p.route("k")
    assert how == "sticky" and engine.keys == 1


async def test_a_saturated_engine_spills_one_call_without_moving_the_key() -> None:
    p, fakes = pool(2, spill_at_in_flight=2)
    await p.generate([1], routing_key="k")
    home = p.route("k")[0]
    fakes[home.url].hold = asyncio.Event()
    held = [asyncio.create_task(p.generate([1], routing_key="k")) for _ in range(2)]
    await asyncio.sleep(0)
    assert home.in_flight == 2
    engine, how = p.route("k")
    assert how == "spill" and engine is not home
    fakes[home.url].hold.set()
    await asyncio.gather(*held)
    assert p.route("k") == (home, "sticky")


async def test_no_spill_without_a_limit() -> None:
    p, _ = pool(2)
    await p.generate([1], routing_key="k")
    home = p.route("k")[0]
    home.in_flight = 1000
    assert p.route("k") == (home, "sticky")


async def test_model_info_reports_the_oldest_version_of_the_engines_that_answer() -> None:
    p, fakes = pool(3)
    for version, fake in zip([3, 2, 3], fakes.values(), strict=True):
        fake.version = version
    info = await p.get_model_info()
    assert info["weight_version"] == 2 and info["engines_answered"] == 3
    fakes["http://e1"].down = True
    info = await p.get_model_info()
    assert info["weight_version"] == 3 and info["engines_answered"] == 2
    assert not p.engines[1].is_up(time.monotonic())
    for fake in fakes.values():
        fake.down = True
    with pytest.raises(InferenceUnavailable, match="no engine answered"):
        await p.get_model_info()


def test_the_key_table_is_bounded_and_keeps_its_counts() -> None:
    p, _ = pool(2, max_keys=3)
    for key in "abcde":
        p.route(key)
    assert len(p._key_engine) == 3 and sum(e.keys for e in p.engines) == 3
    assert list(p._key_engine) == ["c", "d", "e"]


def test_a_pool_refuses_no_urls_and_duplicates() -> None:
    with pytest.raises(ValueError, match="at least one"):
        EnginePool([], lambda url: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="duplicate"):
        EnginePool(["http://a", "http://a/"], lambda url: None)  # type: ignore[arg-type, return-value]


async def test_the_client_sends_the_routing_key_as_sglang_routers_header() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        meta = {"finish_reason": {"type": "stop"}, "cached_tokens": 5, "weight_version": "1"}
        return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": meta})

    client = InferenceClient("http://engine", transport=httpx.MockTransport(handler))
    got = await client.generate([1, 2], max_new_tokens=1, routing_key="g/3")
    await client.generate([1, 2], max_new_tokens=1)
    await client.aclose()
    assert seen[0].headers["x-smg-routing-key"] == "g/3"
    assert seen[0].headers["content-type"] == "application/json"
    assert "x-smg-routing-key" not in seen[1].headers
    assert got.cached_tokens == 5


async def test_a_frozen_engine_is_avoided_and_its_calls_given_up() -> None:
    """Frozen (SIGSTOP, a stuck CUDA call): its connections stay open and nothing answers, so
    no call fails by itself; the health probe notices, the calls in flight are given up as
    unavailable (their callers retry elsewhere), and the engine is used again once it answers."""
    p, fakes = pool(2, probe_s=0.01, probe_timeout_s=0.05, probe_misses=2)
    frozen = fakes["http://e0"]
    assert (await p.generate([1], routing_key="a")).text == "http://e0"
    before = FROZEN.labels("http://e0")._value.get()
    frozen.thawed.clear()
    with pytest.raises(InferenceUnavailable, match="stopped answering"):
        await asyncio.wait_for(p.generate([1], routing_key="a"), 5)
    assert FROZEN.labels("http://e0")._value.get() == before + 1
    assert (await p.generate([1], routing_key="a")).text == "http://e1"  # the key moved
    assert (await asyncio.wait_for(p.get_model_info(), 5))["engines_answered"] == 1
    frozen.thawed.set()
    for _ in range(500):  # the next probe answered
        if p.engines[0].is_up(time.monotonic()):
            break
        await asyncio.sleep(0.01)
    assert p.engines[0].is_up(time.monotonic())
    assert (await p.generate([1], routing_key="b")).text == "http://e0"  # new keys fill it
    await p.aclose()


async def test_a_cancelled_caller_is_cancelled_not_unavailable() -> None:
    p, fakes = pool(1, probe_s=0.01, probe_timeout_s=1.0)
    fakes["http://e0"].hold = asyncio.Event()
    call = asyncio.create_task(p.generate([1]))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not p.engines[0].calls
    await p.aclose()


async def test_the_pool_follows_engines_added_and_gone_during_the_run() -> None:
    """engines.discover: an engine announced mid-run takes new keys; one that left is
    dropped with its keys (they move at their next call)."""
    fakes = {u: FakeEngine(u) for u in ("http://a", "http://b", "http://c")}
    found = ["http://a"]

    async def discover() -> list[str]:
        return list(found)

    pool = EnginePool(
        ["http://a"],
        lambda u: fakes[u],
        discover=discover,
        discover_s=0.01,  # type: ignore[arg-type,return-value]
    )
    assert (await pool.generate([1], routing_key="k1")).text == "http://a"
    found.append("http://b")
    await asyncio.sleep(0.1)
    assert [e.url for e in pool.engines] == ["http://a", "http://b"]
    assert (await pool.generate([1], routing_key="k2")).text == "http://b"  # least keys
    assert (await pool.generate([1], routing_key="k1")).text == "http://a"  # sticky
    found.remove("http://a")
    await asyncio.sleep(0.1)
    assert [e.url for e in pool.engines] == ["http://b"]
    assert (await pool.generate([1], routing_key="k1")).text == "http://b"
    with pytest.raises(ValueError, match="at least one"):
        await pool.set_urls([])
    await pool.aclose()
