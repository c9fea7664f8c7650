"""The chat template's function-calling format: strict `<tool_call>` parsing, every bad call
answered and counted, and the trainer's ids equal to the template's rendering of the whole
conversation (Qwen2.5-Instruct's template on the tiny tokenizer)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator.config import RolloutConfig, SearchConfig, ToolConfig
from orchestrator.formats.function_calling import parse_tool_calls
from orchestrator.prompt import prompt_token_ids
from orchestrator.rollout import Rollout
from orchestrator.sample import Prompt, Sample, Status, new_group
from orchestrator.tokenizer import rust_tokenizer
from orchestrator.tools.metrics import TOOL_CALLS
from orchestrator.tools.registry import build_toolbox
from orchestrator.tools.search import SearchTool
from orchestrator.tools.toolbox import UNKNOWN
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_rollout import DOCS, FakeRetriever
from tests.unit.orchestrator.test_search import Flaky

# Qwen2.5-Instruct's chat template (its tokenizer_config.json), tool branches included.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == "
    "'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are "
    "Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n    "
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user '
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    '\\n<tools>" }}\n    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | '
    'tojson }}\n    {%- endfor %}\n    {{- "\\n</tools>\\n\\nFor each function call, return a '
    "json object with function name and arguments within <tool_call></tool_call> XML tags:"
    '\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == "
    "'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, "
    "created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif "
    '%}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == "user") or '
    '(message.role == "system" and not loop.first) or (message.role == "assistant" and not '
    "message.tool_calls) %}\n        {{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" "
    "%}\n        {{- '<|im_start|>' + message.role }}\n        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n        {%- endif %}\n        {%- for "
    "tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined "
    "%}\n                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson '
    "}}\n            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- "
    "'<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n        {%- if "
    '(loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n            {{- '
    "'<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n        {%- if "
    'loop.last or (messages[loop.index0 + 1].role != "tool") %}\n            {{- '
    "'<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if "
    "add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
EOT = "<|im_end|>"
PROMPT = Prompt(
    prompt_id="mt/train/0",
    data_source="mt",
    messages=[{"role": "user", "content": "How many years apart? Answer in <answer></answer>."}],
    golds=["14"],
)


def call(name: str, **arguments: Any) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


T1 = "I will look it up.\n" + call("search", query="capital of france") + EOT
T2 = call("calculator", expression="1969 - 1955") + "\n" + call("search", query="lyon") + EOT
T3 = "<answer> 14 </answer>" + EOT


@pytest.fixture(scope="module")
def qwen_tok(tiny_model_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = QWEN25_TEMPLATE
    return tok


async def make(
    tok: Any, turns: list[str], tools: list[Any] | None = None, retriever: Any = None, **cfg: Any
) -> tuple[ScriptedEngine, Rollout, Sample]:
    cfgs = [ToolConfig.model_validate(t) for t in (tools or ["search", "calculator"])]
    rcfg = RolloutConfig(tools=cfgs, action_format="function_calling", max_turns=4, **cfg)
    search = SearchTool(
        retriever or FakeRetriever(), SearchConfig(topk=2, limits=dict(max_attempts=1))
    )
    box = await build_toolbox(rcfg.tools, search)
    engine = ScriptedEngine(tok, turns)
    rollout = Rollout(rcfg, engine, box, rust_tokenizer(tok))
    # The loop renders the prompt without tools; the rollout renders it with them.
    [s] = new_group(
        PROMPT, prompt_token_ids(tok, PROMPT.messages), group_size=1, rollout_step=0, run_id="r"
    )
    await rollout.run_sample(s)
    return engine, rollout, s


def tool_call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


async def test_trainer_ids_equal_the_templates_rendering_of_the_conversation(qwen_tok) -> None:  # type: ignore[no-untyped-def]
    engine, rollout, s = await make(qwen_tok, [T1, T2, T3])
    assert s.status == Status.ANSWERED and [t.action for t in s.turns] == ["tool", "tool", "answer"]
    conversation = [
        *PROMPT.messages,
        {
            "role": "assistant",
            "content": "I will look it up.",
            "tool_calls": [tool_call("search", query="capital of france")],
        },
        {"role": "tool", "name": "search", "content": DOCS},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                tool_call("calculator", expression="1969 - 1955"),
                tool_call("search", query="lyon"),
            ],
        },
        {"role": "tool", "name": "calculator", "content": "14"},
        {"role": "tool", "name": "search", "content": DOCS},
        {"role": "assistant", "content": "<answer> 14 </answer>"},
    ]
    tools = rollout.tools.schemas()
    text = qwen_tok.apply_chat_template(conversation, tools=tools, tokenize=False)
    # The one deliberate difference: the template closes the last turn with a newline after
    # its end-of-turn token; the model stops at the token.
    assert text.endswith(EOT + "\n")
    expected = qwen_tok.encode(text.removesuffix("\n"), add_special_tokens=False)
    assert s.prompt_ids + s.response_ids == expected
    # The prompt holds the tools; every engine call's context is a prefix of the conversation.
    assert s.prompt_ids == prompt_token_ids(qwen_tok, PROMPT.messages, tools=tools)
    assert all(expected[: len(c["input_ids"])] == c["input_ids"] for c in engine.calls)
    # Model tokens train; the tool turns (and the headers around them) do not.
    model = [qwen_tok.encode(t, add_special_tokens=False) for t in (T1, T2, T3)]
    obs = [i for i, m in zip(s.response_ids, s.loss_mask, strict=True) if m == 0]
    assert sum(s.loss_mask) == sum(map(len, model))
    assert qwen_tok.decode(obs).count("<tool_response>") == 3
    assert qwen_tok.decode(s.response_ids) == s.response_text
    # Function calling stops on the end-of-turn token, not on Search-R1's tags.
    assert all(c["stop"] == [] for c in engine.calls)
    assert '"name": "calculator"' in s.turns[1].query and s.turns[1].doc_ids == ["7", "9"]


def test_parsing_is_strict() -> None:
    ok = parse_tool_calls('x <tool_call>{"name": "a", "arguments": {"q": 1}}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in ok] == [("a", {"q": 1}, "")]
    assert parse_tool_calls("no call here <answer> 1 </answer>") == []
    bad = {
        "<tool_call>{name: a}</tool_call>": "not JSON",
        '<tool_call>{"name": "a"}</tool_call>': "expected",
        '<tool_call>{"name": "a", "arguments": "{}"}</tool_call>': "expected",
        '<tool_call>{"name": "a", "arguments": {}, "x": 1}</tool_call>': "expected",
        '<tool_call>["a", {}]</tool_call>': "expected",
        '<tool_call>{"name": "a", "arguments": {}}': "without </tool_call>",
    }
    for text, why in bad.items():
        [c] = parse_tool_calls(text)
        assert why in c.error, text


async def test_a_malformed_call_is_answered_and_counted(qwen_tok) -> None:  # type: ignore[no-untyped-def]
    before = TOOL_CALLS.labels(UNKNOWN, "malformed")._value.get()
    _, _, s = await make(qwen_tok, ["<tool_call>{name: search}</tool_call>" + EOT, T3])
    assert s.status == Status.ANSWERED and s.turns[0].action == "invalid"
    assert "malformed tool call: not JSON" in s.turns[0].error
    assert "<tool_response>\nError: malformed tool call: not JSON" in s.response_text
    assert not s.infrastructure_failure  # the policy's doing
    assert TOOL_CALLS.labels(UNKNOWN, "malformed")._value.get() == before + 1


async def test_an_unknown_tool_is_answered_and_counted(qwen_tok) -> None:  # type: ignore[no-untyped-def]
    before = TOOL_CALLS.labels(UNKNOWN, "unknown")._value.get()
    _, _, s = await make(qwen_tok, [call("weather", city="Paris") + EOT, T3])
    assert s.turns[0].action == "invalid" and not s.infrastructure_failure
    assert "Error: unknown tool 'weather'; the tools are: search, calculator" in s.response_text
    assert TOOL_CALLS.labels(UNKNOWN, "unknown")._value.get() == before + 1


async def test_bad_arguments_are_answered_and_counted(qwen_tok) -> None:  # type: ignore[no-untyped-def]
    before = TOOL_CALLS.labels("calculator", "malformed")._value.get()
    _, _, s = await make(qwen_tok, [call("calculator", expr="1+1") + EOT, T3])
    assert "Error: bad arguments: 'expression' is a required property" in s.response_text
    assert TOOL_CALLS.labels("calculator", "malformed")._value.get() == before + 1


async def test_a_tool_timeout_is_shown_counted_and_flags_the_sample(qwen_tok) -> None:  # type: ignore[no-untyped-def]
    before = TOOL_CALLS.labels("search", "failed")._value.get()
    s = await _timeout_case(qwen_tok)
    assert "Search failed: timed out after 0.05s" in s.response_text
    assert s.infrastructure_failure and s.turns[0].error == "timed out after 0.05s"
    assert TOOL_CALLS.labels("search", "failed")._value.get() == before + 1


async def _timeout_case(tok: Any) -> Sample:
    rcfg = RolloutConfig(tools=["search"], action_format="function_calling")
    # A retriever that is ready but slow: the call times out, the breaker stays closed.
    search = SearchTool(
        Flaky(0, delay=5), SearchConfig(limits=dict(timeout_s=0.05, max_attempts=1))
    )
    box = await build_toolbox(rcfg.tools, search)
    rollout = Rollout(rcfg, ScriptedEngine(tok, [T1, T3]), box, tok)
    [s] = new_group(PROMPT, [], group_size=1, rollout_step=0, run_id="r")
    return await rollout.run_sample(s)


async def test_a_message_without_a_call_is_the_answer(qwen_tok) -> None:  # type: ignore[no-untyped-def]
    _, _, s = await make(qwen_tok, [T3])
    assert (
        s.status == Status.ANSWERED
        and len(s.turns) == 1
        and s.loss_mask == [1] * len(s.response_ids)
    )


async def test_results_are_truncated_to_observation_max_tokens(qwen_tok) -> None:  # type: ignore[no-untyped-def]
    _, _, s = await make(qwen_tok, [T1, T3], observation_max_tokens=4)
    assert "[truncated]\n</tool_response>" in s.response_text
    assert DOCS not in s.response_text
