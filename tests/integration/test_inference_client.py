"""Contract tests of `InferenceClient` against a server speaking SGLang's native API.

Every test runs against our reference engine and, under `-m sglang` (`python3 dev.py sglang`),
against a real SGLang 0.5.21 serving the same tiny model: one body, both servers. Where the two
differ on purpose the test says so (`target.is_sglang`); docs/inference.md has the table.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from engine_client.client import InferenceBadRequest, InferenceClient
from tests.support.engines import ENGINES, Target, engine_server

TOKEN = "test-admin-token"


@pytest.fixture(scope="module", params=ENGINES)
def target(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Target]:
    with engine_server(request.param, tiny_model_dir, admin_token=TOKEN) as t:
        yield t


def vocab_size(target: Target) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(target.model_dir).vocab_size)


@pytest.fixture
async def client(target: Target) -> AsyncIterator[InferenceClient]:
    # As the orchestrator sets it up: token ids outside the vocabulary are never sent.
    c = InferenceClient(target.url, token=target.token, timeout_s=60, vocab_size=vocab_size(target))
    yield c
    await c.aclose()


@pytest.fixture(scope="module")
def model(target: Target) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

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
        ([1], {"max_new_tokens": 4, "stop_token_ids": [10**7]}),
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


async def test_out_of_vocabulary_ids_never_reach_the_engine(target: Target) -> None:
    """One such id kills a whole SGLang 0.5.21 server: the client refuses to send it."""
    n = vocab_size(target)
    c = InferenceClient(target.url, vocab_size=n, timeout_s=30)
    try:
        for ids in ([1, n], [-1]):
            with pytest.raises(InferenceBadRequest, match="outside the vocabulary") as info:
                await c.generate(ids, max_new_tokens=2)
            assert info.value.status == 422
        assert (await c.generate([1, n - 1], max_new_tokens=2)).completion_tokens == 2
    finally:
        await c.aclose()
    if not target.is_sglang:  # our engine rejects them itself too (SGLang would crash)
        async with httpx.AsyncClient(base_url=target.url, timeout=30) as http:
            r = await http.post("/generate", json={"input_ids": [1, n]})
        assert r.status_code == 400 and "out of range" in r.text


async def test_max_new_tokens_zero_is_an_empty_answer(target: Target) -> None:
    async with httpx.AsyncClient(base_url=target.url, timeout=30) as http:
        r = await http.post(
            "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}
        )
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == [] and r.json()["meta_info"]["completion_tokens"] == 0


async def test_unknown_sampling_field_is_an_error(target: Target) -> None:
    """`seed` is not SGLang's name (`sampling_seed` is; the client sends that). SGLang answers
    500, which a client would retry as a server fault; our engine answers 400."""
    async with httpx.AsyncClient(base_url=target.url, timeout=30) as http:
        r = await http.post("/generate", json={"input_ids": [1], "sampling_params": {"seed": 3}})
    if target.is_sglang:
        assert r.status_code == 500  # "Internal Server Error", nothing more
    else:
        assert r.status_code == 400 and "seed" in r.text


async def test_weight_versions_and_model_info_shapes(target: Target) -> None:
    async with httpx.AsyncClient(base_url=target.url, timeout=30) as http:
        r = await http.post(
            "/generate",
            json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}},
        )
        info = (await http.get("/get_model_info")).json()
    meta = r.json()["meta_info"]
    version = meta["weight_version"]
    assert isinstance(version, str) and version == info["weight_version"]
    # The tiny random model may sample its stop token before max_new_tokens: the span covers
    # however many tokens came out (CI saw 2 of 3 once).
    made = meta["completion_tokens"]
    assert 1 <= made <= 3
    assert meta["weight_versions"] == [{"version": version, "start": 0, "end": made}]
    assert {"model_path", "is_generation", "weight_version"} <= set(info)
    # SGLang does not report the dtype: a weight sender takes it from config there.
    assert ("dtype" in info) is (not target.is_sglang)


async def test_weight_update_session_protocol(target: Target) -> None:
    """SGLang 0.5.21 applies distributed updates only inside begin/end_weight_update."""
    headers = {"Authorization": f"Bearer {target.token}"}
    update = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1, 1]]}
    async with httpx.AsyncClient(base_url=target.url, timeout=30, headers=headers) as http:
        r = await http.post("/update_weights_from_distributed", json=update)
        assert r.status_code == 400 and "begin_weight_update" in r.json()["message"]
        r = await http.post("/end_weight_update", json={})
        assert r.status_code == 400 and "no weight-update session" in r.json()["message"]
        assert (await http.post("/begin_weight_update", json={})).status_code == 200
        r = await http.post("/begin_weight_update", json={})
        assert r.status_code == 400 and "already open" in r.json()["message"]
        assert (await http.post("/end_weight_update", json={})).status_code == 200


async def test_prompt_plus_budget_over_the_context_is_rejected(
    target: Target, client: InferenceClient
) -> None:
    """SGLang 0.5.21 rejects a request whose prompt + max_new_tokens exceeds the context (it
    truncates only with --allow-auto-truncate); the orchestrator asks for what still fits."""
    from transformers import AutoConfig

    context = int(AutoConfig.from_pretrained(target.model_dir).max_position_embeddings)
    prompt = [1] * (context - 20)  # SGLang also refuses inputs over context - 6
    with pytest.raises(InferenceBadRequest) as info:
        await client.generate(prompt, max_new_tokens=21, temperature=0)
    assert 400 <= info.value.status < 500 and "context" in str(info.value)
    out = await client.generate(prompt, max_new_tokens=20, temperature=0)
    assert out.completion_tokens <= 20


async def test_logprobs_are_of_the_temperature_scaled_distribution(
    client: InferenceClient, model: torch.nn.Module
) -> None:
    """SGLang's logprobs at temperature T are log_softmax(logits / T) (before top-k/top-p);
    the trainer divides by the same T."""
    out = await client.generate(PROMPT, max_new_tokens=16, temperature=0.7, seed=3)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out.output_ids])).logits[0].float()
    lp = torch.log_softmax(logits / 0.7, -1)
    ref = [float(lp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(out.output_ids)]
    assert out.logprobs is not None
    assert max(abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)) < 1e-4


def engine_metric(url: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples (those whose labels contain `label`, e.g. a
    'finish_reason="abort"' pair) in the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            pairs = {f'{k}="{v}"' for k, v in s.labels.items()}
            if s.name == name and (not label or label in pairs):
                total += s.value
    return total


async def test_work_of_a_client_that_went_away_is_aborted(target: Target) -> None:
    """A request whose client disconnected (its timeout, a killed orchestrator) used to run to
    its end, so the client's retries piled up in the engine until it answered 429."""
    running = (
        "sglang:num_running_reqs" if target.is_sglang else "searchr1_inference_running_requests"
    )
    aborted = 'finish_reason="abort"'
    before = engine_metric(target.url, "searchr1_inference_requests_total", aborted)
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=target.url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/generate", json=body)
    for _ in range(300):  # the engine notices within its poll interval (SGLang: 4 s)
        if engine_metric(target.url, running) == 0:
            break
        await asyncio.sleep(0.05)
    assert engine_metric(target.url, running) == 0  # 4000 tokens take far longer
    if not target.is_sglang:
        assert engine_metric(target.url, "searchr1_inference_requests_total", aborted) == (
            before + 1
        )


async def test_model_info_route_and_its_deprecated_name(target: Target) -> None:
    """SGLang 0.5.21 deprecates /get_model_info (a warning in its log at every call, and the
    orchestrator polls it): the client asks /model_info, and both names answer the same."""
    async with httpx.AsyncClient(base_url=target.url, timeout=30) as http:
        new, old = (
            (await http.get("/model_info")).json(),
            (await http.get("/get_model_info")).json(),
        )
    assert new["model_path"] == old["model_path"] and new["weight_version"] == old["weight_version"]
    seen: list[str] = []

    async def record(request: httpx.Request) -> None:
        seen.append(request.url.path)

    c = InferenceClient(target.url, timeout_s=30)
    c._http.client.event_hooks["request"].append(record)  # type: ignore[attr-defined]
    try:
        await c.get_model_info()
        await c.get_model_info()
    finally:
        await c.aclose()
    # Once: is it sglang-router (an engine has no worker list); then only the new name.
    assert seen == ["/workers", "/model_info", "/model_info"]
