"""Contract tests of `InferenceClient` against a server speaking SGLang's native API.

By default the server is our reference engine, run as a real process. With
`SEARCHR1_SGLANG_URL=http://host:port` (and `-m sglang`) the same tests run against a real SGLang
serving the same tiny model (`SEARCHR1_SGLANG_MODEL`: its local directory, for teacher forcing;
build it with `searchr1 inference make-tiny-model`). See docs/inference.md.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from inference.client import InferenceBadRequest, InferenceClient
from inference.process import InferenceServerProcess

TOKEN = "test-admin-token"


@dataclass
class Target:
    url: str
    model_dir: Path | None
    token: str | None
    is_sglang: bool


@pytest.fixture(
    scope="module",
    params=["torch", pytest.param("sglang", marks=pytest.mark.sglang)],
)
def target(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Target]:
    if request.param == "sglang":
        url = os.environ.get("SEARCHR1_SGLANG_URL")
        if not url:
            pytest.skip("SEARCHR1_SGLANG_URL is not set")
        model = os.environ.get("SEARCHR1_SGLANG_MODEL")
        yield Target(
            url, Path(model) if model else None, os.environ.get("SEARCHR1_ADMIN_TOKEN"), True
        )
        return
    with InferenceServerProcess(tiny_model_dir, admin_token=TOKEN) as server:
        yield Target(server.url, tiny_model_dir, TOKEN, False)


@pytest.fixture
async def client(target: Target) -> AsyncIterator[InferenceClient]:
    c = InferenceClient(target.url, token=target.token, timeout_s=60)
    yield c
    await c.aclose()


@pytest.fixture(scope="module")
def model(target: Target) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if target.model_dir is None:
        pytest.skip("no local model directory for teacher forcing")
    return AutoModelForCausalLM.from_pretrained(target.model_dir).eval()


PROMPT = [1, 50, 51, 52, 53]


async def test_generate_with_stop_string_keeps_it(client: InferenceClient) -> None:
    free = await client.generate(PROMPT, max_new_tokens=32, temperature=0)
    assert free.finish_reason == "length" and free.completion_tokens == 32
    assert free.prompt_tokens == len(PROMPT)
    stop = free.text[8:11]
    assert len(stop) == 3
    out = await client.generate(PROMPT, max_new_tokens=32, temperature=0, stop=[stop])
    assert out.finish_reason == "stop" and out.matched_stop == stop
    assert stop in out.text  # no_stop_trim=True is the client default: the tag stays
    assert out.output_ids == free.output_ids[: len(out.output_ids)]
    assert len(out.output_ids) < 32 and len(out.logprobs or []) == len(out.output_ids)


async def test_logprobs_match_teacher_forcing(
    client: InferenceClient, model: torch.nn.Module
) -> None:
    for kwargs in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5}):
        out = await client.generate(PROMPT, max_new_tokens=24, **kwargs)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + out.output_ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        ref = [float(lp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(out.output_ids)]
        assert out.logprobs is not None
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)) < 1e-4


async def test_finish_reasons_length_stop_token_abort(client: InferenceClient) -> None:
    free = await client.generate(PROMPT, max_new_tokens=6, temperature=0)
    assert free.finish_reason == "length"
    tok = free.output_ids[3]
    out = await client.generate(PROMPT, max_new_tokens=6, temperature=0, stop_token_ids=[tok])
    assert out.finish_reason == "stop" and out.matched_stop == tok
    assert out.output_ids[-1] == tok

    long = asyncio.create_task(client.generate(PROMPT, max_new_tokens=3000, temperature=0))
    await asyncio.sleep(0.3)
    await client.pause_generation("abort")
    try:
        aborted = await long
    finally:
        await client.continue_generation()
    assert aborted.finish_reason == "abort" and aborted.completion_tokens < 3000


async def test_32_concurrent_requests_all_correct(client: InferenceClient) -> None:
    prompts = [[1, *range(200, 200 + k)] for k in range(1, 33)]
    alone = [await client.generate(p, max_new_tokens=16, temperature=0) for p in prompts]
    together = await asyncio.gather(
        *(client.generate(p, max_new_tokens=16, temperature=0) for p in prompts)
    )
    for a, b in zip(alone, together, strict=True):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize(
    ("ids", "kwargs"),
    [
        ([], {"max_new_tokens": 4}),
        ([1, 10**7], {"max_new_tokens": 4}),
        ([1], {"max_new_tokens": 0}),
        ([1], {"max_new_tokens": 10**6}),
    ],
)
async def test_bad_input_is_4xx_and_engine_keeps_serving(
    client: InferenceClient, ids: list[int], kwargs: dict
) -> None:
    with pytest.raises(InferenceBadRequest) as info:
        await client.generate(ids, **kwargs)
    assert 400 <= info.value.status < 500
    assert (await client.generate([1], max_new_tokens=2, temperature=0)).completion_tokens == 2


async def test_malformed_json_is_4xx(target: Target) -> None:
    async with httpx.AsyncClient(base_url=target.url) as http:
        r = await http.post(
            "/generate", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert 400 <= r.status_code < 500


async def test_model_info_health_and_flush(client: InferenceClient) -> None:
    info = await client.get_model_info()
    assert isinstance(info["weight_version"], int) and info["model_path"]
    assert await client.health_generate()
    await client.flush_cache()


async def test_state_changing_endpoints_need_the_token(target: Target) -> None:
    if target.token is None:
        pytest.skip("the server has no admin token")
    anon = InferenceClient(target.url, timeout_s=30)
    try:
        for call in (anon.flush_cache(), anon.pause_generation(), anon.continue_generation()):
            with pytest.raises(InferenceBadRequest) as info:
                await call
            assert info.value.status == 401
        with pytest.raises(InferenceBadRequest):
            await anon.update_weights_from_disk("/nonexistent")
        # generation itself is open
        assert (await anon.generate([1], max_new_tokens=1)).completion_tokens == 1
    finally:
        await anon.aclose()


async def test_update_from_disk_bad_path_is_4xx(client: InferenceClient) -> None:
    before = (await client.get_model_info())["weight_version"]
    with pytest.raises(InferenceBadRequest):
        await client.update_weights_from_disk("/nonexistent/checkpoint")
    assert (await client.get_model_info())["weight_version"] == before


async def test_raw_protocol_fields(target: Target) -> None:
    """SGLang's wire format as is: `text` input, logprob triples, string weight_version."""
    async with httpx.AsyncClient(base_url=target.url, timeout=30) as http:
        r = await http.post(
            "/generate",
            json={
                "text": "Question: who?",
                "sampling_params": {"max_new_tokens": 3, "temperature": 0},
                "return_logprob": True,
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        meta = body["meta_info"]
        assert len(body["output_ids"]) == 3 and isinstance(body["text"], str)
        assert meta["finish_reason"] == {"type": "length", "length": 3}
        assert isinstance(meta["weight_version"], str)
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == body["output_ids"]
        assert all(t[2] is None and t[0] <= 0 for t in triples)
        r = await http.post("/generate", json={"input_ids": [1], "sampling_params": {"top_p": 2}})
        assert r.status_code == 400 and "top_p" in r.text
