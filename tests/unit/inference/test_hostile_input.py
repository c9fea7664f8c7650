"""Hostile input to the open `/generate` route, in-process (httpx ASGITransport).

Every bad request must be a 4xx naming the field, never a 500, never garbage, and never harm
the requests batched next to it (issue 15).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from inference.config import TorchEngineConfig
from inference.engine import TorchEngine
from inference.server import create_app


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:
    eng = TorchEngine(tiny_model_dir, TorchEngineConfig())
    yield eng
    eng.shutdown()


@pytest.fixture
async def http(engine: TorchEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(engine), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as c:
        yield c


async def post_raw(http: httpx.AsyncClient, body: str) -> httpx.Response:
    # Raw text: Python's json module reads Infinity / NaN, so FastAPI hands them on as floats.
    return await http.post(
        "/generate", content=body.encode(), headers={"content-type": "application/json"}
    )


async def post_escaped(http: httpx.AsyncClient, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as "\\ud800" (httpx's encoder cannot send one).
    return await post_raw(http, json.dumps(body))


async def still_serves(http: httpx.AsyncClient) -> None:
    # ignore_eos: the random tiny model samples its end-of-sequence token now and then (a
    # one-token answer failed a CI run), and the check is that the engine serves, not how long.
    params = {"max_new_tokens": 2, "ignore_eos": True}
    r = await http.post("/generate", json={"input_ids": [1, 2], "sampling_params": params})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", "Infinity"),
        ("max_new_tokens", "-Infinity"),
        ("max_new_tokens", "NaN"),
        ("top_k", "Infinity"),
        ("top_k", "NaN"),
        ("sampling_seed", "Infinity"),
        ("sampling_seed", "NaN"),
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("top_p", "NaN"),
        ("max_new_tokens", "2.5"),
        ("max_new_tokens", "true"),
        ("sampling_seed", '"7"'),
        ("temperature", '"hot"'),
        ("ignore_eos", '"false"'),
        ("stop", "[1]"),
        ("stop_token_ids", '["2"]'),
    ],
)
async def test_non_finite_or_mistyped_sampling_fields_are_400_naming_the_field(
    http: httpx.AsyncClient, field: str, value: str
) -> None:
    r = await post_raw(http, f'{{"input_ids": [1, 2], "sampling_params": {{"{field}": {value}}}}}')
    assert r.status_code == 400, (r.status_code, r.text)
    assert f"sampling_params.{field}" in r.json()["detail"]
    await still_serves(http)


@pytest.mark.parametrize("seed", [2**63, 2**64, 2**70, -(2**63) - 1])
async def test_seed_outside_sglang_range_is_400(http: httpx.AsyncClient, seed: int) -> None:
    # SGLang 0.5.21 (`SamplingParams.verify`): sampling_seed in [-2**63, 2**63 - 1].
    r = await post_raw(
        http, f'{{"input_ids": [1], "sampling_params": {{"sampling_seed": {seed}}}}}'
    )
    assert r.status_code == 400, (r.status_code, r.text)
    assert "sampling_params.sampling_seed" in r.json()["detail"]


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1])
async def test_seed_inside_sglang_range_is_served_reproducibly(
    http: httpx.AsyncClient, seed: int
) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "sampling_seed": seed}}
    a, b = [await http.post("/generate", json=body) for _ in range(2)]
    assert a.status_code == 200, a.text
    assert a.json()["output_ids"] == b.json()["output_ids"]


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (["x"] * 33, "at most 32"),
        (["x" * 257], "at most 256"),
        (["\ud800"], "sampling_params.stop.0"),
    ],
)
async def test_stop_strings_are_limited(
    http: httpx.AsyncClient, stop: list[str], message: str
) -> None:
    r = await post_escaped(http, {"input_ids": [1], "sampling_params": {"stop": stop}})
    assert r.status_code == 400, (r.status_code, r.text)
    assert message in r.json()["detail"]


async def test_stop_strings_at_the_limits_are_served(http: httpx.AsyncClient) -> None:
    stop = ["x" * 256] + [f"never-{i}" for i in range(31)]
    r = await http.post(
        "/generate", json={"input_ids": [1], "sampling_params": {"stop": stop, "max_new_tokens": 3}}
    )
    assert r.status_code == 200, r.text


async def test_stop_token_ids_are_limited(http: httpx.AsyncClient) -> None:
    params = {"stop_token_ids": list(range(1025))}
    r = await http.post("/generate", json={"input_ids": [1], "sampling_params": params})
    assert r.status_code == 400 and "sampling_params.stop_token_ids" in r.json()["detail"]


async def test_a_poisoned_request_does_not_fail_its_batch_neighbours(
    http: httpx.AsyncClient,
) -> None:
    # Long neighbours are in the decode batch when the hostile request arrives.
    body = {"input_ids": [1, 3], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    neighbours = [asyncio.create_task(http.post("/generate", json=body)) for _ in range(4)]
    await asyncio.sleep(0.05)
    hostile = await post_escaped(
        http, {"input_ids": [1], "sampling_params": {"stop": ["\ud800"], "max_new_tokens": 4}}
    )
    assert 400 <= hostile.status_code < 500
    for r in await asyncio.gather(*neighbours):
        assert r.status_code == 200, r.text


async def test_text_with_a_lone_surrogate_is_400(http: httpx.AsyncClient) -> None:
    r = await post_escaped(http, {"text": "who\ud800", "sampling_params": {}})
    assert r.status_code == 400, (r.status_code, r.text)
    assert "text" in r.json()["detail"]


async def test_text_is_tokenized_off_the_event_loop(
    http: httpx.AsyncClient, engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    encode = engine.tokenizer.encode

    def spy(text: str, *args: object, **kwargs: object) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    r = await http.post("/generate", json={"text": "hello there", "sampling_params": {}})
    assert r.status_code == 200, r.text
    assert threads and threading.main_thread().name not in threads


async def test_text_far_beyond_the_context_is_refused_before_tokenizing(
    http: httpx.AsyncClient, engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    encode = engine.tokenizer.encode

    def spy(text: str, *args: object, **kwargs: object) -> list[int]:
        calls.append(len(text))
        return encode(text, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    text = "a " * (engine.context_length * 16)
    r = await http.post("/generate", json={"text": text})
    assert r.status_code == 400, r.text
    assert "text" in r.json()["detail"] and "characters" in r.json()["detail"]
    assert calls == []


async def test_an_rid_with_a_lone_surrogate_is_4xx(http: httpx.AsyncClient) -> None:
    # The rid comes back in meta_info.id: an answer holding "\ud800" cannot be encoded.
    r = await post_escaped(http, {"input_ids": [1], "rid": "r\ud800", "sampling_params": {}})
    assert r.status_code == 422, (r.status_code, r.text)
    assert "rid" in r.json()["error"]
