"""The gateway driven by the real `openai` client (in-process, over the app), with tool calls:
the published trajectory's ids are the template's rendering of the whole conversation, the
mask is 1 exactly on the engine's own output ids (with its logprobs) and 0 on the template's
tokens in between; streaming gives the same answers and the same ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway import metrics
from protos.trajectory import Trajectory
from searchr1.chat_template import prompt_token_ids
from tests.unit.gateway.conftest import EOT, call_text, tool_schema

TOOLS = [tool_schema("search", query="string"), tool_schema("calculator", expression="string")]
T1 = "I will look it up.\n" + call_text("search", query="capital of france") + EOT
T2 = call_text("calculator", expression="1969 - 1955") + "\n" + call_text("search", query="lyon")
T2 += EOT
T3 = "<answer> 14 </answer>" + EOT
QUESTION = [{"role": "user", "content": "How many years apart? Answer in <answer></answer>."}]


def runs(mask: bytes) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out: list[tuple[int, int, int]] = []
    for i, v in enumerate(mask):
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1], i + 1)
        else:
            out.append((v, i, i + 1))
    return out


def template_ids(tok: Any, conversation: list[dict[str, Any]], tools: list[Any]) -> list[int]:
    """The template's rendering of a finished conversation, as the model stops: at its last
    end-of-turn token (the template adds a newline after it)."""
    text = tok.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert text.endswith(EOT + "\n")
    return list(tok.encode(text.removesuffix("\n"), add_special_tokens=False))


def assert_token_exact(
    traj: Trajectory, tok: Any, turns: list[str], expected: list[int], calls: list[dict[str, Any]]
) -> None:
    ids = list(traj.prompt_token_ids) + list(traj.response_token_ids)
    assert ids == expected
    # Every engine call read a prefix of the conversation: the context was never rebuilt.
    assert all(expected[: len(c["input_ids"])] == c["input_ids"] for c in calls)
    model_runs = [(a, b) for v, a, b in runs(traj.loss_mask) if v == 1]
    response = list(traj.response_token_ids)
    # Mask 1 exactly on the engine's output ids, one run per call, as it emitted them.
    assert [tok.decode(response[a:b]) for a, b in model_runs] == turns
    assert len(model_runs) == len(calls) == len(traj.turns)
    n = sum(b - a for a, b in model_runs)
    ones = [lp for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m]
    assert ones == pytest.approx([-(k + 1) / 1000 for k in range(n)])
    zeros = [lp for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if not m]
    assert set(zeros) <= {0.0}
    assert traj.has_rollout_logprobs


def conversation_of(tool_results: list[list[tuple[str, str]]], final: str) -> list[dict[str, Any]]:
    def tc(name: str, **arguments: Any) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "arguments": arguments}}

    return [
        *QUESTION,
        {
            "role": "assistant",
            "content": "I will look it up.",
            "tool_calls": [tc("search", query="capital of france")],
        },
        *({"role": "tool", "name": n, "content": c} for n, c in tool_results[0]),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [tc("calculator", expression="1969 - 1955"), tc("search", query="lyon")],
        },
        *({"role": "tool", "name": n, "content": c} for n, c in tool_results[1]),
        {"role": "assistant", "content": final},
    ]


RESULTS = [[("search", "Paris is the capital.")], [("calculator", "14"), ("search", "Lyon.")]]


async def test_openai_client_tool_calls_are_token_exact(make_rig, qwen_tok) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig([T1, T2, T3])
    client = rig.openai("s1")
    messages: list[dict[str, Any]] = list(QUESTION)
    finishes = []
    for step in range(3):
        r = await client.chat.completions.create(model="any", messages=messages, tools=TOOLS)
        choice = r.choices[0]
        finishes.append(choice.finish_reason)
        messages.append(choice.message.model_dump(exclude_none=True))
        for call, (name, content) in zip(
            choice.message.tool_calls or [], RESULTS[step] if step < 2 else [], strict=True
        ):
            assert call.function.name == name
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    assert finishes == ["tool_calls", "tool_calls", "stop"]
    first = messages[1]
    assert first["content"] == "I will look it up."
    assert json.loads(first["tool_calls"][0]["function"]["arguments"]) == {
        "query": "capital of france"
    }
    assert messages[-1]["content"] == "<answer> 14 </answer>"
    assert r.usage is not None and r.usage.completion_tokens == len(qwen_tok.encode(T3))

    await rig.gateway.end("s1", reward=1.0)
    [traj] = await rig.published(1)
    expected = template_ids(qwen_tok, conversation_of(RESULTS, "<answer> 14 </answer>"), TOOLS)
    assert_token_exact(traj, qwen_tok, [T1, T2, T3], expected, rig.engine.calls)
    assert traj.prompt_token_ids == prompt_token_ids(qwen_tok, QUESTION, tools=TOOLS)
    assert traj.reward.total == 1.0 and traj.group_size == 1 and traj.sample_index == 0
    assert [t.action for t in traj.turns] == ["tool", "tool", "answer"]
    assert [c.name for c in traj.turns[1].tool_calls] == ["calculator", "search"]
    assert traj.metadata["segments"] == "1"
    # The session's id kept its calls on one engine (sglang-router's manual policy).
    assert {c["routing_key"] for c in rig.engine.calls} == {"s1"}
    assert all(c["return_logprob"] and c["no_stop_trim"] for c in rig.engine.calls)


async def test_streaming_gives_the_same_answers_and_ids(make_rig, qwen_tok) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig([T1, T2, T3])
    client = rig.openai("s-stream")
    messages: list[dict[str, Any]] = list(QUESTION)
    for step in range(3):
        stream = await client.chat.completions.create(
            model="any",
            messages=messages,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
        content, calls, finish, usage = "", {}, None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
                for d in choice.delta.tool_calls or []:
                    c = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
        assert usage is not None and usage.completion_tokens > 0
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            assert finish == "tool_calls"
            msg["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls.values()
            ]
        messages.append(msg)
        for call, (_, result) in zip(
            msg.get("tool_calls", []), RESULTS[step] if step < 2 else [], strict=True
        ):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    assert messages[-1]["content"] == "<answer> 14 </answer>"
    await rig.gateway.end("s-stream", reward=0.5)
    [traj] = await rig.published(1)
    expected = template_ids(qwen_tok, conversation_of(RESULTS, "<answer> 14 </answer>"), TOOLS)
    assert_token_exact(traj, qwen_tok, [T1, T2, T3], expected, rig.engine.calls)


async def test_a_cut_turn_gets_its_end_of_turn_from_the_template(make_rig, qwen_tok) -> None:  # type: ignore[no-untyped-def]
    long = "word " * 40 + EOT
    rig = make_rig([long, "ok" + EOT])
    client = rig.openai("s-cut")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "talk"}]
    r = await client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    messages += [r.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "user", "content": "go on"}]
    r2 = await client.chat.completions.create(model="m", messages=messages)
    assert r2.choices[0].message.content == "ok"
    await rig.gateway.end("s-cut", reward=0.0)
    [traj] = await rig.published(1)
    response = list(traj.response_token_ids)
    first = response[:5]
    assert list(traj.loss_mask[:5]) == [1] * 5
    # After the cut: <|im_end|> and the user turn, mask 0; then the model's "ok<|im_end|>".
    bridge_end = len(response) - len(qwen_tok.encode("ok" + EOT))
    bridge = qwen_tok.decode(response[5:bridge_end])
    assert bridge == EOT + "\n<|im_start|>user\ngo on" + EOT + "\n<|im_start|>assistant\n"
    assert set(traj.loss_mask[5:bridge_end]) == {0} and set(traj.loss_mask[bridge_end:]) == {1}
    assert qwen_tok.decode(first) == r.choices[0].message.content


async def test_stop_strings_end_the_content_but_stay_in_the_ids(make_rig, qwen_tok) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["The answer </answer>"])
    client = rig.openai("s-stop")
    r = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "q"}], stop=["</answer>"]
    )
    assert r.choices[0].message.content == "The answer "
    assert rig.engine.calls[0]["stop"] == ["</answer>"]
    await rig.gateway.end("s-stop", reward=1.0)
    [traj] = await rig.published(1)
    assert qwen_tok.decode(list(traj.response_token_ids)) == "The answer </answer>"


async def test_identical_request_replays_the_answer(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["first" + EOT, "second" + EOT])
    client = rig.openai("s-retry")
    before = metrics.CHAT.labels("replay")._value.get()
    msgs = [{"role": "user", "content": "hi"}]
    a = await client.chat.completions.create(model="m", messages=msgs)
    b = await client.chat.completions.create(model="m", messages=msgs)
    assert a.id == b.id and b.choices[0].message.content == "first"
    assert len(rig.engine.calls) == 1
    assert metrics.CHAT.labels("replay")._value.get() == before + 1


async def test_models_lists_the_served_policy(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["x"])
    models = await rig.openai().models.list()
    assert [m.id for m in models.data] == ["tiny"]
