"""Client retry policy and response parsing (a flaky fake server via httpx.MockTransport)."""

from __future__ import annotations

import httpx
import pytest

from engine_client.client import (
    InferenceBadRequest,
    InferenceClient,
    InferenceUnavailable,
    parse_generate,
    parse_weight_version,
)
from searchr1.redis_server import free_port

OK_BODY = {
    "text": "<search> x </search>",
    "output_ids": [5, 6, 7],
    "meta_info": {
        "finish_reason": {"type": "stop", "matched": "</search>"},
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "weight_version": "2",
        "output_token_logprobs": [[-0.5, 5, None], [-1.0, 6, None], [-0.25, 7, None]],
    },
}


def flaky(statuses: list[int], seen: list[httpx.Request]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        status = statuses.pop(0) if statuses else 200
        if status == 200:
            return httpx.Response(200, json=OK_BODY)
        return httpx.Response(status, json={"detail": f"status {status}"})

    return httpx.MockTransport(handler)


async def test_retries_5xx_then_succeeds() -> None:
    seen: list[httpx.Request] = []
    c = InferenceClient("http://x", backoff_s=0.001, transport=flaky([503, 500], seen))
    out = await c.generate([1, 2, 3, 4], max_new_tokens=8, stop=["</search>"], seed=3)
    assert len(seen) == 3
    assert out.output_ids == [5, 6, 7] and out.logprobs == [-0.5, -1.0, -0.25]
    assert out.finish_reason == "stop" and out.matched_stop == "</search>"
    assert out.weight_version == 2 and out.prompt_tokens == 4
    body = httpx.Request("POST", "http://x", content=seen[0].content).read()
    assert b'"sampling_seed":3' in body and b'"no_stop_trim":true' in body
    await c.aclose()


async def test_gives_up_after_max_retries() -> None:
    seen: list[httpx.Request] = []
    c = InferenceClient(
        "http://x", max_retries=2, backoff_s=0.001, transport=flaky([502] * 9, seen)
    )
    with pytest.raises(InferenceUnavailable, match="502"):
        await c.generate([1], max_new_tokens=1)
    assert len(seen) == 3
    await c.aclose()


async def test_4xx_is_never_retried() -> None:
    seen: list[httpx.Request] = []
    c = InferenceClient("http://x", backoff_s=0.001, transport=flaky([400], seen))
    with pytest.raises(InferenceBadRequest, match="status 400") as info:
        await c.generate([1], max_new_tokens=1)
    assert info.value.status == 400 and len(seen) == 1
    await c.aclose()


async def test_connection_refused_is_unavailable() -> None:
    c = InferenceClient(f"http://127.0.0.1:{free_port()}", max_retries=1, backoff_s=0.001)
    with pytest.raises(InferenceUnavailable):
        await c.generate([1], max_new_tokens=1)
    assert not await c.health_generate()
    await c.aclose()


def test_weight_version_parsing() -> None:
    assert parse_weight_version("3") == 3
    assert parse_weight_version("default") == 0  # SGLang before any versioned update
    assert parse_weight_version(None) == 0


def test_parse_without_logprobs_and_abort() -> None:
    body = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}
    out = parse_generate(body, return_logprob=False)
    assert out.finish_reason == "abort" and out.logprobs is None and out.completion_tokens == 0


async def test_a_call_never_outlives_its_total_deadline() -> None:
    """Read timeouts used to be retried 3 x 600 s whatever the caller's own budget."""
    import asyncio

    attempts: list[float] = []

    async def slow(request: httpx.Request) -> httpx.Response:
        attempts.append(0.0)
        await asyncio.sleep(0.3)
        return httpx.Response(503, json={"detail": "busy"})

    c = InferenceClient(
        "http://x", max_retries=50, backoff_s=0.01, transport=httpx.MockTransport(slow)
    )
    with pytest.raises(InferenceUnavailable, match="deadline"):
        await c.generate([1], max_new_tokens=1, deadline_s=1.0)
    assert 2 <= len(attempts) <= 5  # not the 51 attempts the retry count alone allows
    await c.aclose()


async def test_retries_stopped_by_the_deadline_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next retry's backoff would end past the deadline: the call stops there, and says the
    deadline stopped it (it raised the last 503 alone, as if retries had run out: the test
    above flaked on it)."""
    import engine_client.client as client_module

    monkeypatch.setattr(client_module.random, "random", lambda: 0.9)  # backoff 0.8 x 1.4

    def busy(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"detail": "busy"})

    c = InferenceClient(
        "http://x", max_retries=50, backoff_s=0.8, transport=httpx.MockTransport(busy)
    )
    with pytest.raises(InferenceUnavailable, match=r"deadline of 1.0s \(last: .*busy"):
        await c.generate([1], max_new_tokens=1, deadline_s=1.0)
    await c.aclose()


async def test_model_info_falls_back_to_the_old_route() -> None:
    seen: list[str] = []

    def old_server(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/model_info":
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json={"model_path": "m", "weight_version": "3"})

    c = InferenceClient("http://x", transport=httpx.MockTransport(old_server))
    assert (await c.get_model_info())["weight_version"] == 3
    assert (await c.get_model_info())["weight_version"] == 3
    # Asked once each: is it sglang-router (no: no worker list), which route it has.
    assert seen == ["/workers", "/model_info", "/get_model_info", "/get_model_info"]
    await c.aclose()
