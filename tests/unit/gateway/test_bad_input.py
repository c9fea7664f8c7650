"""Bad input gets a 4xx with a message saying what is wrong, counted by reason in
`searchr1_gateway_rejected_total`; none of it reaches the engine."""

from __future__ import annotations

from typing import Any

import pytest
from openai import BadRequestError, ConflictError, NotFoundError

from gateway import metrics
from tests.unit.gateway.conftest import EOT, call_text, tool_schema

USER = [{"role": "user", "content": "hi"}]


def rejected(reason: str) -> float:
    return float(metrics.REJECTED.labels(reason)._value.get())


@pytest.mark.parametrize(
    ("body", "reason", "says"),
    [
        ({"tools": [{"type": "function"}]}, "invalid_tools", "tools[0].function"),
        ({"tools": [{"type": "retrieval"}]}, "invalid_tools", "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "invalid_tools", "name"),
        (
            {"tools": [tool_schema("a"), tool_schema("a")]},
            "invalid_tools",
            "duplicate function 'a'",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]},
            "invalid_tools",
            "parameters",
        ),
        ({"tool_choice": "required", "tools": [tool_schema("a")]}, "unsupported_tool_choice", ""),
        (
            {"tool_choice": {"type": "function", "function": {"name": "a"}}},
            "unsupported_tool_choice",
            "only 'auto' and 'none'",
        ),
        ({"n": 2}, "bad_request", "n: only 1"),
        ({"response_format": {"type": "json_object"}}, "bad_request", "json_object"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "bad_request", "stop"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "invalid_messages", "role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "invalid_messages",
            "'image_url' parts",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "a", "arguments": "{oops"}}],
                    },
                ]
            },
            "invalid_messages",
            "arguments: not JSON",
        ),
    ],
)
async def test_bad_requests_are_400_with_a_message(
    make_rig, body: dict[str, Any], reason: str, says: str
) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["x" + EOT])
    before = rejected(reason)
    async with rig.http() as http:
        r = await http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": USER, **body},
            headers={"X-Session-Id": "bad"},
        )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == reason and says in error["message"]
    assert error["type"] == "invalid_request_error"
    assert rejected(reason) == before + 1
    assert rig.engine.calls == []


async def test_a_session_must_be_named(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["x" + EOT])
    before = rejected("no_session")
    with pytest.raises(BadRequestError, match="X-Session-Id"):
        await rig.openai().chat.completions.create(model="m", messages=USER)
    assert rejected("no_session") == before + 1
    # The body's `user` names it when there is no header.
    r = await rig.openai().chat.completions.create(model="m", messages=USER, user="by-user")
    assert r.choices[0].message.content == "x"
    assert rig.gateway.table.get("by-user").turns == 1


async def test_session_ids_and_group_headers_are_checked(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["x" + EOT])
    with pytest.raises(BadRequestError, match="session id"):
        await rig.openai("has space").chat.completions.create(model="m", messages=USER)
    with pytest.raises(BadRequestError, match="X-Group-Size"):
        await rig.openai("s", **{"X-Group-Id": "g", "X-Group-Size": "two"}).chat.completions.create(
            model="m", messages=USER
        )
    ok = rig.openai("s1", **{"X-Group-Id": "g", "X-Group-Size": "1"})
    await ok.chat.completions.create(model="m", messages=USER)
    with pytest.raises(ConflictError, match="has its 1 sessions"):
        await rig.openai("s2", **{"X-Group-Id": "g", "X-Group-Size": "1"}).chat.completions.create(
            model="m", messages=USER
        )
    with pytest.raises(ConflictError, match="has size 1, not 3"):
        await rig.openai("s3", **{"X-Group-Id": "g", "X-Group-Size": "3"}).chat.completions.create(
            model="m", messages=USER
        )


async def test_calls_and_rewards_after_the_end_are_409(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["x" + EOT])
    client = rig.openai("done")
    await client.chat.completions.create(model="m", messages=USER)
    await rig.gateway.end("done", reward=1.0)
    before = rejected("session_ended")
    with pytest.raises(ConflictError, match="has ended"):
        await client.chat.completions.create(model="m", messages=USER)
    async with rig.http() as http:
        r = await http.post("/v1/sessions/done/reward", json={"reward": 0.0})
        assert r.status_code == 409 and "has ended" in r.json()["error"]["message"]
        r = await http.post("/v1/sessions/done/end", json={})
        assert r.status_code == 409
    assert rejected("session_ended") == before + 3
    with pytest.raises(NotFoundError):
        await rig.openai().with_options(base_url="http://gateway/sessions/ghost/v1").models.list()


async def test_a_malformed_tool_call_is_returned_as_text_and_counted(make_rig) -> None:  # type: ignore[no-untyped-def]
    broken = '<tool_call>\n{"name": "search", "arguments": "not an object"}\n</tool_call>' + EOT
    rig = make_rig([broken])
    before = float(metrics.MALFORMED_CALLS._value.get())
    r = await rig.openai("mal").chat.completions.create(
        model="m", messages=USER, tools=[tool_schema("search", query="string")]
    )
    msg = r.choices[0].message
    assert msg.tool_calls is None and msg.content == broken.removesuffix(EOT)
    assert r.choices[0].finish_reason == "stop"
    assert float(metrics.MALFORMED_CALLS._value.get()) == before + 1
    turn = rig.gateway.table.get("mal").segments[0].turns[0]
    assert "malformed tool call" in turn.error


async def test_tool_choice_none_returns_calls_as_text(make_rig) -> None:  # type: ignore[no-untyped-def]
    text = call_text("search", query="x") + EOT
    rig = make_rig([text])
    r = await rig.openai("none").chat.completions.create(
        model="m", messages=USER, tools=[tool_schema("search", query="string")], tool_choice="none"
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == text.removesuffix(EOT)


async def test_a_conversation_past_the_context_is_400(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["x" + EOT], context_length=16)
    before = rejected("context_length_exceeded")
    with pytest.raises(BadRequestError, match="context"):
        await rig.openai("long").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "word " * 50}]
        )
    assert rejected("context_length_exceeded") == before + 1


async def test_the_admin_token_guards_every_route(make_rig, qwen_tok) -> None:  # type: ignore[no-untyped-def]
    from pydantic import SecretStr

    from gateway.server import create_app

    rig = make_rig(["x" + EOT])
    app = create_app(rig.gateway, token=SecretStr("s3cret"))
    import httpx
    from openai import AsyncOpenAI, AuthenticationError

    def client(key: str) -> AsyncOpenAI:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g")
        return AsyncOpenAI(
            base_url="http://g/v1",
            api_key=key,
            http_client=http,
            default_headers={"X-Session-Id": "tok"},
        )

    with pytest.raises(AuthenticationError):
        await client("wrong").chat.completions.create(model="m", messages=USER)
    r = await client("s3cret").chat.completions.create(model="m", messages=USER)
    assert r.choices[0].message.content == "x"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as h:
        assert (await h.post("/v1/sessions/tok/end", json={})).status_code == 401
        assert (await h.get("/health")).status_code == 200


async def test_engine_failures_are_503_and_aborts_are_regenerated(make_rig) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from openai import InternalServerError

    from engine_client.client import InferenceUnavailable

    rig = make_rig(["ok" + EOT], max_abort_retries=1)
    scripted = rig.engine.generate
    plan: list[str] = []

    async def engine(input_ids: list[int], **kw: Any) -> Any:
        step = plan.pop(0) if plan else "ok"
        if step == "down":
            raise InferenceUnavailable("/generate: connection refused")
        result = await scripted(input_ids, **kw)
        return replace(result, finish_reason="abort") if step == "abort" else result

    rig.engine.generate = engine  # type: ignore[method-assign]
    client = rig.openai("flaky")
    before = {r: rejected(r) for r in ("engine_unavailable", "engine_aborted")}
    aborts = float(metrics.ENGINE_ABORTS._value.get())
    plan[:] = ["down"]
    with pytest.raises(InternalServerError, match="engine unavailable"):
        await client.chat.completions.create(model="m", messages=USER)
    plan[:] = ["abort", "abort"]
    with pytest.raises(InternalServerError, match="aborted"):
        await client.chat.completions.create(model="m", messages=USER)
    plan[:] = ["abort"]  # a weight update: the call is generated again, in full
    r = await client.chat.completions.create(model="m", messages=USER)
    assert r.choices[0].message.content == "ok"
    assert {r: rejected(r) - before[r] for r in before} == {
        "engine_unavailable": 1,
        "engine_aborted": 1,
    }
    assert float(metrics.ENGINE_ABORTS._value.get()) == aborts + 2
    # Nothing of the failed calls was recorded: one segment, one turn.
    s = rig.gateway.table.get("flaky")
    assert [len(seg.turns) for seg in s.segments] == [1]
