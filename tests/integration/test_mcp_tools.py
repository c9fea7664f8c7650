"""Tools from real MCP server processes: our SDK-built server (tests/support/mcp_server.py)
over stdio and streamable HTTP, and the third-party `mcp-server-calculator` (PyPI, stdio).

Every failure mode is counted and shown to the policy: each runs through a function-calling
rollout (the scripted policy of the unit tests) and the error is read in the response text.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import RolloutConfig, ToolConfig
from orchestrator.rollout import Rollout
from orchestrator.sample import Prompt, Sample, Status, new_group
from orchestrator.tools.metrics import TOOL_CALLS, TOOL_FAILURES
from orchestrator.tools.registry import build_toolbox
from orchestrator.tools.toolbox import UNKNOWN, Toolbox
from searchr1.redis_server import free_port
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_tools_function_calling import QWEN25_TEMPLATE

ROOT = Path(__file__).resolve().parents[2]
SERVER = [sys.executable, "-m", "tests.support.mcp_server"]
EOT = "<|im_end|>"
PROMPT = Prompt("mcp/test/0", "mcp", [{"role": "user", "content": "Add 2 and 3."}], ["5"])


def calculator_command() -> list[str]:
    path = shutil.which("mcp-server-calculator") or str(
        Path(sys.executable).parent / "mcp-server-calculator"
    )
    if not Path(path).exists():
        pytest.fail("mcp-server-calculator is not installed (the dev extras install it)")
    return [path]


def stdio(**kw: Any) -> ToolConfig:
    server = {"command": [*SERVER, "stdio"], "env": {"PYTHONPATH": str(ROOT)}}
    return ToolConfig.model_validate({"name": "test", "mcp": server, **kw})


def call(name: str, **arguments: Any) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def count(tool: str, outcome: str) -> float:
    return TOOL_CALLS.labels(tool, outcome)._value.get()


@pytest.fixture
async def box(request: pytest.FixtureRequest) -> AsyncIterator[Toolbox]:
    cfg: ToolConfig = getattr(request, "param", None) or stdio()
    toolbox = await build_toolbox([cfg], None)
    try:
        yield toolbox
    finally:
        await toolbox.aclose()


async def roll(tokenizer: Any, box: Toolbox, turns: list[str]) -> Sample:
    cfg = RolloutConfig(
        tools=[ToolConfig(name="mcp")], action_format="function_calling", max_turns=4
    )
    rollout = Rollout(cfg, ScriptedEngine(tokenizer, turns), box, tokenizer)
    [s] = new_group(PROMPT, [], group_size=1, rollout_step=0, run_id="mcp")
    return await rollout.run_sample(s)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = QWEN25_TEMPLATE  # tool turns as Qwen2.5 renders them
    return tok


# --- discovery and calls -----------------------------------------------------------------


async def test_stdio_server_tools_are_discovered_and_called(box: Toolbox, tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert box.names == ["add", "slow", "fail", "crash"]
    schema = box.get("add").parameters  # type: ignore[union-attr]
    assert schema["required"] == ["a", "b"]
    s = await roll(tokenizer, box, [call("add", a=2, b=3) + EOT, "<answer> 5 </answer>" + EOT])
    assert s.status == Status.ANSWERED and "<tool_response>\n5\n</tool_response>" in s.response_text


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = (tmp_path / "mcp-http.log").open("w")
    proc = subprocess.Popen([*SERVER, "http", str(port)], cwd=ROOT, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while True:  # until it listens (or died, or the deadline)
            assert proc.poll() is None, (tmp_path / "mcp-http.log").read_text()
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "the MCP HTTP server did not start"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


async def test_streamable_http_server(http_server: str) -> None:
    cfg = ToolConfig.model_validate(
        {"name": "web", "mcp": {"url": http_server, "include": ["add"]}}
    )
    box = await build_toolbox([cfg], None)
    try:
        assert box.names == ["add"]
        out = await box.call("add", {"a": 40, "b": 2})
        assert out.text == "42" and out.error == ""
    finally:
        await box.aclose()


async def test_third_party_calculator_server(tokenizer) -> None:  # type: ignore[no-untyped-def]
    cfg = ToolConfig.model_validate({"name": "calc", "mcp": {"command": calculator_command()}})
    box = await build_toolbox([cfg], None)
    try:
        assert box.names == ["calculate"]
        turns = [call("calculate", expression="1969 - 1955") + EOT, "<answer> 14 </answer>" + EOT]
        s = await roll(tokenizer, box, turns)
        assert "<tool_response>\n14\n</tool_response>" in s.response_text
        assert s.status == Status.ANSWERED and not s.turns[0].error
    finally:
        await box.aclose()


# --- failure modes: each counted and shown to the policy ---------------------------------


@pytest.mark.parametrize(
    "box", [stdio(limits={"timeout_s": 0.5, "max_attempts": 1})], indirect=True
)
async def test_timeout(box: Toolbox, tokenizer) -> None:  # type: ignore[no-untyped-def]
    before = count("slow", "failed"), TOOL_FAILURES.labels("slow", "TimeoutError")._value.get()
    s = await roll(tokenizer, box, [call("slow", seconds=30) + EOT, "done" + EOT])
    assert "Tool slow failed: timed out after 0.5s" in s.response_text
    assert s.infrastructure_failure
    after = count("slow", "failed"), TOOL_FAILURES.labels("slow", "TimeoutError")._value.get()
    assert after == (before[0] + 1, before[1] + 1)


async def test_malformed_call_and_bad_arguments(box: Toolbox, tokenizer) -> None:  # type: ignore[no-untyped-def]
    before = count(UNKNOWN, "malformed"), count("add", "malformed")
    turns = [
        '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>' + EOT,
        call("add", a="two", b=3) + EOT,
        "done" + EOT,
    ]
    s = await roll(tokenizer, box, turns)
    assert "Error: malformed tool call: not JSON" in s.response_text
    assert "Error: bad arguments at a: 'two' is not of type 'integer'" in s.response_text
    assert not s.infrastructure_failure
    assert (count(UNKNOWN, "malformed"), count("add", "malformed")) == (
        before[0] + 1,
        before[1] + 1,
    )


async def test_the_tools_own_error(box: Toolbox, tokenizer) -> None:  # type: ignore[no-untyped-def]
    before = count("fail", "failed")
    s = await roll(tokenizer, box, [call("fail", message="no such year") + EOT, "done" + EOT])
    assert "no such year" in s.response_text and not s.infrastructure_failure
    assert count("fail", "failed") == before + 1


async def test_unknown_tool(box: Toolbox, tokenizer) -> None:  # type: ignore[no-untyped-def]
    before = count(UNKNOWN, "unknown")
    s = await roll(tokenizer, box, [call("multiply", a=2, b=3) + EOT, "done" + EOT])
    assert "Error: unknown tool 'multiply'; the tools are: add, slow, fail, crash" in (
        s.response_text
    )
    assert count(UNKNOWN, "unknown") == before + 1


@pytest.mark.parametrize(
    "box",
    [
        stdio(
            limits={
                "timeout_s": 5,
                "max_attempts": 1,
                "breaker_failures": 1,
                "breaker_probe_s": 0.05,
            }
        )
    ],
    indirect=True,
)
async def test_server_down_is_shown_and_the_probe_starts_it_again(box: Toolbox, tokenizer) -> None:  # type: ignore[no-untyped-def]
    before = count("crash", "failed")
    s = await roll(tokenizer, box, [call("crash") + EOT, "done" + EOT])
    assert "Tool crash failed:" in s.response_text and s.infrastructure_failure
    assert count("crash", "failed") == before + 1
    # The breaker's probe (a ping, then a new connection) brings a stdio server back.
    for _ in range(3):
        out = await asyncio.wait_for(box.call("add", {"a": 1, "b": 1}), 60)
        if out.text == "2":
            break
        assert out.error and not out.call_error  # the down server, shown
    assert out.text == "2"


async def test_a_server_that_does_not_answer_fails_the_start() -> None:
    dead = ToolConfig.model_validate(
        {
            "name": "dead",
            "mcp": {"command": [sys.executable, "-c", "pass"], "connect_timeout_s": 5},
        }
    )
    with pytest.raises(ValueError, match=r"rollout\.tools\[0\] \(dead\): MCP server .* did not"):
        await build_toolbox([dead], None)
    nowhere = ToolConfig.model_validate(
        {
            "name": "nowhere",
            "mcp": {"url": f"http://127.0.0.1:{free_port()}/mcp", "connect_timeout_s": 3},
        }
    )
    with pytest.raises(ValueError, match="did not answer"):
        await build_toolbox([nowhere], None)
    missing = stdio()
    assert missing.mcp is not None
    missing.mcp.include = ["divide"]
    with pytest.raises(ValueError, match=r"has no tool \['divide'\]"):
        await build_toolbox([missing], None)
