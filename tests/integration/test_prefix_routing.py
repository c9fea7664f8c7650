"""Two engine processes behind our routing: the turns of a sample (and the samples of a group)
land on the engine that holds their prefix, so later turns are served from cache (issue 28's
bar: >= 80% of their prefix tokens), and both engines take a share of the keys.

Routed by the orchestrator's EnginePool (engines.urls, no router) or by a
real sglang-router with the policy our launcher gives it (manual, min_load assignment) and our
client's X-SMG-Routing-Key; over our reference engine (prefix cache on) or real SGLang 0.5.21
(radix cache on by default). What needs SGLang's environment (its servers, or the router that
`dev.py sglang` installs beside them) runs under `-m sglang`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import httpx
import pytest

from engine_client.client import InferenceClient, InferenceUnavailable
from engine_client.pool import EnginePool
from harness.inference_server import InferenceServerProcess, RouterProcess
from harness.multiturn import drive
from tests.support.engines import ENGINES, Target, engine_server, sglang_python

CACHE_ON = {"SEARCHR1_INFERENCE__TORCH_ENGINE__PREFIX_CACHE_TOKENS": "65536"}
ROUTES = ["pool", pytest.param("router", marks=pytest.mark.sglang)]


@pytest.fixture(scope="module", params=ENGINES)
def engines(request, tiny_model_dir) -> Iterator[list[Target]]:  # type: ignore[no-untyped-def]
    with (
        engine_server(request.param, tiny_model_dir, env=CACHE_ON) as a,
        engine_server(request.param, tiny_model_dir, env=CACHE_ON) as b,
    ):
        yield [a, b]


def cached_prefill_tokens(target: Target) -> float:
    """What our engine counts as served from its cache (SGLang: 0, it has no such counter
    without --enable-metrics; its answers' cached_tokens are checked instead)."""
    if target.is_sglang:
        return 0.0
    text = httpx.get(f"{target.url}/metrics").text
    match = re.search(r'searchr1_inference_prefill_tokens_total\{source="cached"\} (\S+)', text)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("route", ROUTES)
async def test_turns_meet_their_prefix_on_either_engine(engines, route) -> None:  # type: ignore[no-untyped-def]
    urls = [e.url for e in engines]
    router = None
    if route == "router":
        router = RouterProcess(urls, python=sglang_python()).start()
        client = InferenceClient(router.url)
        generate, close = client.generate, client.aclose
    else:
        pool = EnginePool(urls, lambda url: InferenceClient(url))
        generate, close = pool.generate, pool.aclose
    before = [cached_prefill_tokens(e) for e in engines]
    try:
        stats = await drive(
            generate, groups=6, group_size=3, turns=3, prompt_tokens=96,
            observation_tokens=40, max_new_tokens=16, vocab=(10, 2000), key="group",
            seed=len(route),
        )  # fmt: skip
    finally:
        await close()
        if router is not None:
            router.stop()
    assert stats.calls == 6 * 3 * 3
    assert stats.hit_rate("later") >= 0.8, stats
    after = [cached_prefill_tokens(e) for e in engines]
    if not engines[0].is_sglang:  # each engine served some of the cached tokens
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    if route == "pool":
        assert all(e.keys == 3 for e in pool.engines), [e.keys for e in pool.engines]


@pytest.mark.slow  # over 10 s: CI's slow phase (issue 45)
async def test_an_engine_that_goes_away_hands_its_keys_on_and_takes_new_ones_back(
    tiny_model_dir,  # type: ignore[no-untyped-def]
) -> None:
    # The orchestrator's rollout retries a call that failed on a down engine; the retry lands
    # on a live one, where the key stays. A restarted engine rejoins and takes new keys.
    a = InferenceServerProcess(tiny_model_dir, env=CACHE_ON).start()
    b = InferenceServerProcess(tiny_model_dir, env=CACHE_ON).start()
    pool = EnginePool(
        [a.url, b.url], lambda url: InferenceClient(url, max_retries=0), retry_down_s=0.5
    )

    async def call(key: str) -> str:
        for _ in range(3):
            try:
                await pool.generate([1, *range(100, 140)], max_new_tokens=2, routing_key=key)
                return pool.route(key)[0].url
            except InferenceUnavailable:
                await asyncio.sleep(0.1)
        raise AssertionError(f"{key}: no engine answered")

    try:
        homes = {key: await call(key) for key in ("k0", "k1", "k2", "k3")}
        assert set(homes.values()) == {a.url, b.url}
        a.stop()
        assert {await call(key) for key in homes} == {b.url}  # every key now on b ...
        assert [await call(key) for key in homes] == [b.url] * 4  # ... and stays there
        port = a.port
        a = InferenceServerProcess(tiny_model_dir, env=CACHE_ON, port=port).start()
        await asyncio.sleep(0.6)  # a's down time is over: it is tried again
        assert await call("k-new") == a.url  # the idle engine takes the new key
        assert [await call(key) for key in homes] == [b.url] * 4  # old keys stay with their cache
    finally:
        await pool.aclose()
        a.stop()
        b.stop()
