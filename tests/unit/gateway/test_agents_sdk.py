"""The OpenAI Agents SDK (0.24), unmodified, as an agent behind the gateway: its function tool
is called, its replayed history extends the session (one segment), and the trajectory is the
template's rendering of the conversation the SDK sent, the model's turns its own ids.
Non-streamed (`Runner.run`) and streamed (`Runner.run_streamed`)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tests.unit.gateway.conftest import EOT, call_text
from tests.unit.gateway.test_chat import assert_token_exact, template_ids

set_tracing_disabled(True)

T1 = "Let me search.\n" + call_text("search", query="capital of france") + EOT
T2 = "Paris" + EOT


@function_tool
def search(query: str) -> str:
    """Search the web.

    Args:
        query: what to look for.
    """
    return f"Results for {query}: Paris is the capital of France."


def agent_for(rig: Any, session: str, sent: list[dict[str, Any]]) -> Agent:
    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.content))

    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=rig.app),
        base_url="http://gateway",
        event_hooks={"request": [record]},
    )
    client = AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http)
    return Agent(
        name="geo",
        instructions="Answer with one word.",
        tools=[search],
        model=OpenAIChatCompletionsModel("policy", openai_client=client),
        model_settings=ModelSettings(extra_headers={"X-Session-Id": session}),
    )


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_agents_sdk_tool_loop_is_token_exact(make_rig, qwen_tok, streamed: bool) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig([T1, T2])
    sent: list[dict[str, Any]] = []
    agent = agent_for(rig, "sdk", sent)
    if streamed:
        result = Runner.run_streamed(agent, "What is the capital of France?")
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, "What is the capital of France?")
    assert result.final_output == "Paris"
    assert len(sent) == 2 and all(body.get("stream", False) == streamed for body in sent)

    await rig.gateway.end("sdk", reward=1.0)
    [traj] = await rig.published(1)
    assert traj.metadata["segments"] == "1"  # the SDK's history extended the session
    # What the SDK sent last, in the template's form, plus the model's answer.
    last, tools = sent[-1]["messages"], sent[-1]["tools"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool"]
    call = last[2]["tool_calls"][0]["function"]
    conversation = [
        last[0],
        last[1],
        {
            "role": "assistant",
            "content": last[2].get("content") or "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.loads(call["arguments"])},
                }
            ],
        },
        {"role": "tool", "name": "search", "content": last[3]["content"]},
        {"role": "assistant", "content": "Paris"},
    ]
    assert last[2]["content"] == "Let me search."
    assert "Paris is the capital" in last[3]["content"]
    expected = template_ids(qwen_tok, conversation, tools)
    assert_token_exact(traj, qwen_tok, [T1, T2], expected, rig.engine.calls)
