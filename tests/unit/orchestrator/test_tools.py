"""The tool interface: the runner's guarantees for every tool, the built-ins (calculator,
python), custom tools by dotted path, and `rollout.tools` checked at start-up."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from orchestrator.config import (
    CallLimits,
    OrchestratorConfig,
    RolloutConfig,
    SearchConfig,
    ToolConfig,
)
from orchestrator.hooks import HookError
from orchestrator.tools.base import ToolError
from orchestrator.tools.calculator import Calculator, evaluate
from orchestrator.tools.metrics import TOOL_BREAKER_OPEN, TOOL_CALLS, TOOL_FAILURES
from orchestrator.tools.python_exec import PythonTool
from orchestrator.tools.registry import build_toolbox
from orchestrator.tools.search import SearchTool
from orchestrator.tools.toolbox import UNKNOWN, Toolbox
from orchestrator.wiring import Clients, connect_rollout
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_rollout import FakeRetriever
from tests.unit.orchestrator.tool_examples import Echo, Flaky

E = "tests.unit.orchestrator.tool_examples"
FAST = CallLimits(backoff_initial_s=0.001, backoff_max_s=0.01, max_attempts=3)


def calls(tool: str, outcome: str) -> float:
    return TOOL_CALLS.labels(tool, outcome)._value.get()


# --- the runner, for any tool -------------------------------------------------------------


async def test_retries_then_answers_and_counts_ok() -> None:
    before = calls("flaky", "ok")
    flaky = Flaky(failures=2)
    out = await Toolbox.of(flaky, limits=FAST).call("flaky", {})
    assert out.error == "" and out.text == "ok" and out.attempts == 3
    assert calls("flaky", "ok") == before + 1


async def test_exhausted_retries_are_an_explicit_failure_observation() -> None:
    before = TOOL_FAILURES.labels("flaky", "ConnectionError")._value.get()
    out = await Toolbox.of(Flaky(failures=99), limits=FAST).call("flaky", {})
    assert out.attempts == 3 and not out.call_error
    assert out.text == "Tool flaky failed: ConnectionError: refused"
    assert TOOL_FAILURES.labels("flaky", "ConnectionError")._value.get() == before + 1


async def test_a_timeout_is_per_attempt_counted_and_shown() -> None:
    before = TOOL_FAILURES.labels("flaky", "TimeoutError")._value.get()
    limits = CallLimits(timeout_s=0.05, max_attempts=2, backoff_initial_s=0.001, backoff_max_s=0.01)
    out = await Toolbox.of(Flaky(delay=5), limits=limits).call("flaky", {})
    assert out.attempts == 2 and out.error == "timed out after 0.05s"
    assert "timed out after 0.05s" in out.text
    assert TOOL_FAILURES.labels("flaky", "TimeoutError")._value.get() == before + 1


async def test_the_concurrency_cap_is_global_per_tool() -> None:
    flaky = Flaky(delay=0.02)
    box = Toolbox.of(flaky, limits=CallLimits(max_concurrency=3))
    await asyncio.gather(*(box.call("flaky", {}) for _ in range(12)))
    assert flaky.max_in_flight == 3


async def test_the_calls_own_error_is_shown_not_retried_nor_held_against_the_tool() -> None:
    echo = Echo()
    box = Toolbox.of(echo, limits=CallLimits(max_attempts=5, breaker_failures=1))
    out = await box.call("echo", {"text": "refuse"})
    assert echo.calls == 1 and out.call_error and "echo refuses that" in out.text
    assert not box.entries["echo"].runner.breaker_open


async def test_failures_in_a_row_open_the_breaker_which_closes_after_its_cool_down() -> None:
    flaky = Flaky(failures=2)
    limits = CallLimits(max_attempts=1, breaker_failures=2, breaker_probe_s=0.01, **_fast())
    box = Toolbox.of(flaky, limits=limits)
    for _ in range(2):
        assert (await box.call("flaky", {})).error
    runner = box.entries["flaky"].runner
    assert runner.breaker_open and TOOL_BREAKER_OPEN.labels("flaky")._value.get() == 1
    out = await asyncio.wait_for(box.call("flaky", {}), 5)  # waits for the cool-down
    assert out.text == "ok" and not runner.breaker_open
    assert TOOL_BREAKER_OPEN.labels("flaky")._value.get() == 0


def _fast() -> dict[str, float]:
    return {"backoff_initial_s": 0.001, "backoff_max_s": 0.01}


async def test_a_down_tool_makes_calls_wait_at_most_breaker_max_wait_s() -> None:
    class Down(Flaky):
        async def ready(self) -> bool:
            return False

    before = TOOL_FAILURES.labels("flaky", "CircuitOpen")._value.get()
    limits = CallLimits(
        max_attempts=1, breaker_failures=1, breaker_probe_s=0.01, breaker_max_wait_s=0.1, **_fast()
    )
    out = await Toolbox.of(Down(failures=10**9), limits=limits).call("flaky", {})
    assert out.error.startswith("tool 'flaky' down for more than 0.1s") and not out.call_error
    assert TOOL_FAILURES.labels("flaky", "CircuitOpen")._value.get() == before + 1


async def test_unknown_tool_and_bad_arguments_are_answered_and_counted() -> None:
    box = Toolbox.of(Echo())
    before = calls(UNKNOWN, "unknown"), calls("echo", "malformed")
    out = await box.call("nope", {})
    assert out.call_error and out.text == "Error: unknown tool 'nope'; the tools are: echo"
    out = await box.call("echo", {"text": 3})
    assert out.call_error and out.text == "Error: bad arguments at text: 3 is not of type 'string'"
    out = await box.call("echo", ["x"])
    assert "arguments must be a JSON object" in out.text
    assert (calls(UNKNOWN, "unknown"), calls("echo", "malformed")) == (before[0] + 1, before[1] + 2)


async def test_search_is_one_tool_with_its_own_runner_and_failure_text() -> None:
    search = SearchTool(FakeRetriever(), SearchConfig(topk=2))
    box = await build_toolbox([ToolConfig(name="search")], search)
    out = await box.call("search", {"query": "france"})
    assert out.doc_ids == ["7", "9"] and out.text.startswith('Doc 1(Title: "Paris")')
    assert box.entries["search"].runner is search.runner
    assert box.entries["search"].failure_observation == SearchConfig().failure_observation


# --- calculator --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "value"),
    [("1 + 2 * 3", 7), ("(1969 - 1955) * 2", 28), ("7 / 2", 3.5), ("-2 ** 2", -4), ("6/3", 2)],
)
async def test_calculator_computes(expr: str, value: float) -> None:
    assert (await Calculator().call({"expression": expr})).text == str(value)


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("__import__('os').system('true')", "not allowed"),
        ("(1).__class__", "not allowed"),
        ("abs(-1)", "not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "exponent larger"),
        ("10 ** 200", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("[1, 2]", "not allowed"),
        ("1" * 501, "longer than"),
    ],
)
def test_calculator_refuses(expr: str, why: str) -> None:
    with pytest.raises(ToolError, match=why):
        evaluate(expr)


# --- python ------------------------------------------------------------------------------


# The python tool runs code only inside bubblewrap (orchestrator/tools/sandbox.py). Where `bwrap`
# is missing these tests skip, unless this is root with apt-get (CI: `dev.py test` installs it),
# where a missing bwrap fails them. The escape attempts: tests/integration/test_sandbox_escapes.py.
def need_bwrap() -> None:
    if shutil.which("bwrap") is None:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            pytest.fail("no bwrap: `apt-get install -y bubblewrap` (python3 dev.py test does it)")
        pytest.skip("no bwrap (apt-get install -y bubblewrap)")


@pytest.fixture
def requires_bwrap() -> None:
    need_bwrap()


@pytest.mark.usefixtures("requires_bwrap")
async def test_python_runs_code_in_another_process() -> None:
    out = await PythonTool().call({"code": "import os\nprint(6 * 7, os.getpid() != 1)"})
    assert out.text == "42 True\n"


@pytest.mark.usefixtures("requires_bwrap")
async def test_python_wall_time_limit() -> None:
    with pytest.raises(ToolError, match=r"ran longer than 0\.5s"):
        await PythonTool(timeout_s=0.5).call({"code": "import time\ntime.sleep(60)"})


@pytest.mark.usefixtures("requires_bwrap")
async def test_python_cpu_time_limit_ends_a_busy_loop() -> None:
    # The wall limit far above the CPU limit: the kernel's RLIMIT_CPU ends the loop.
    tool = PythonTool(timeout_s=120, cpu_time_s=1)
    with pytest.raises(ToolError, match="CPU time limit of 1s"):
        await tool.call({"code": "while True: pass"})


@pytest.mark.usefixtures("requires_bwrap")
async def test_python_memory_limit() -> None:
    with pytest.raises(ToolError, match="MemoryError"):
        await PythonTool(memory_mb=128).call({"code": "x = bytearray(512 * 1024 * 1024)"})


@pytest.mark.usefixtures("requires_bwrap")
async def test_python_error_is_the_calls_own() -> None:
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        await PythonTool().call({"code": "1 / 0"})


@pytest.mark.usefixtures("requires_bwrap")
async def test_python_output_is_bounded() -> None:
    out = await PythonTool(max_output_chars=100).call({"code": "print('x' * 10**7)"})
    assert out.text == "x" * 100 + "\n[output truncated]"


@pytest.mark.usefixtures("requires_bwrap")
async def test_python_has_no_network_unless_allowed() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
    try:
        # allow_network shares the host's network: the same code reaches the port...
        await PythonTool(allow_network=True).call({"code": code})
        # ...and not by default.
        with pytest.raises(ToolError, match=r"OSError|unreachable|refused"):
            await PythonTool().call({"code": code})
    finally:
        server.close()


def test_python_refuses_to_start_without_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match=r"tool 'python'.*no `bwrap` \(bubblewrap\)"):
        PythonTool()
    with pytest.raises(ValueError, match="bwrap"):
        PythonTool(allow_network=True)  # no way around the sandbox


# --- rollout.tools -----------------------------------------------------------------------


async def test_builtins_and_custom_tools_by_name() -> None:
    cfgs = [
        ToolConfig(name="calculator"),
        ToolConfig(name="mine", factory=f"{E}:make_echo", options={"prefix": ">"}),
        ToolConfig(name="pair", factory=f"{E}:make_two", limits=dict(max_attempts=1)),
    ]
    box = await build_toolbox(cfgs, None)
    assert box.names == ["calculator", "echo", "flaky", "upper"]
    assert (await box.call("calculator", {"expression": "2+2"})).text == "4"
    assert (await box.call("echo", {"text": "a"})).text == ">a"
    assert (await box.call("upper", {"text": "a"})).text == "A"
    assert box.entries["flaky"].runner.limits.max_attempts == 1
    twice = [
        ToolConfig(name="a", factory=f"{E}:make_echo"),
        ToolConfig(name="b", factory=f"{E}:make_echo"),
    ]
    with pytest.raises(ValueError, match="two tools are named 'echo'"):
        await build_toolbox(twice, None)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        ("nope.nowhere:make", "cannot import module"),
        (f"{E}:missing", "has no 'missing'"),
        (f"{E}:no_args", "must accept 1 positional"),
        (f"{E}:not_a_tool", "is no tool"),
        (f"{E}:sync_call", "must be an `async def`"),
        (f"{E}:bad_schema", "no JSON schema"),
    ],
)
async def test_a_bad_custom_tool_fails_the_start_naming_the_entry(factory: str, match: str) -> None:
    with pytest.raises(HookError, match=rf"rollout\.tools\[0\] \(x\).*{match}"):
        await build_toolbox([ToolConfig(name="x", factory=factory)], None)


async def test_unknown_builtin_and_bad_options_fail_the_start() -> None:
    with pytest.raises(ValueError, match="no built-in tool 'calculater'"):
        await build_toolbox([ToolConfig(name="calculater")], None)
    with pytest.raises(ValueError, match=r"rollout\.tools\[0\] \(python\)\.options"):
        await build_toolbox([ToolConfig(name="python", options={"memory": 1})], None)


def test_rollout_config_tools() -> None:
    assert [t.name for t in RolloutConfig().tools] == ["search"]
    cfg = RolloutConfig(tools=["search", "calculator"], action_format="function_calling")
    assert [t.name for t in cfg.tools] == ["search", "calculator"]
    with pytest.raises(ValidationError, match="search_r1 action format has one tool"):
        RolloutConfig(tools=["search", "calculator"])
    with pytest.raises(ValidationError, match="unique"):
        RolloutConfig(tools=["calculator", "calculator"], action_format="function_calling")
    with pytest.raises(ValidationError, match="exactly one of command"):
        ToolConfig(name="m", mcp={})


def test_a_tools_fault_counters_are_exported_at_zero_from_start_up() -> None:
    Toolbox.of(Echo())  # a runner for "echo"; no call yet
    for outcome in ("ok", "failed", "malformed", "unknown"):
        value = REGISTRY.get_sample_value(
            "searchr1_tool_calls_total", {"tool": "echo", "outcome": outcome}
        )
        assert value is not None
    assert (
        REGISTRY.get_sample_value(
            "searchr1_tool_failures_total", {"tool": "echo", "error": "TimeoutError"}
        )
        is not None
    )
    assert (
        REGISTRY.get_sample_value(
            "searchr1_tool_calls_total", {"tool": UNKNOWN, "outcome": "malformed"}
        )
        is not None
    )


async def test_the_service_builds_rollout_tools_once_at_start_up(tokenizer, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    class Engine(ScriptedEngine):
        async def get_model_info(self) -> dict[str, object]:
            return {"weight_version": 0, "model_path": str(tiny_model_dir)}

    cfg = OrchestratorConfig.model_validate(
        {"rollout": {"tools": ["search", "calculator"], "action_format": "function_calling"}}
    )
    clients = Clients(Engine(tokenizer, ["x"]), FakeRetriever(), None)  # type: ignore[arg-type]
    rollout, _ = await connect_rollout(cfg, clients)
    assert rollout.tools is clients.tools and rollout.tools.names == ["search", "calculator"]
    from orchestrator.formats.function_calling import FunctionCallingFormat

    assert isinstance(rollout.format, FunctionCallingFormat) and rollout.stop == []
    again, _ = await connect_rollout(cfg, clients, greedy=True)  # `searchr1 eval`, validation
    assert again.tools is rollout.tools
    bad = OrchestratorConfig.model_validate(
        {
            "rollout": {
                "tools": [{"name": "x", "factory": f"{E}:no_args"}],
                "action_format": "function_calling",
            }
        }
    )
    with pytest.raises(HookError, match=r"rollout\.tools\[0\] \(x\)\.factory"):
        await connect_rollout(bad, Clients(Engine(tokenizer, ["x"]), FakeRetriever(), None))  # type: ignore[arg-type]


def test_limits_on_the_search_entry_of_rollout_tools_are_refused_not_ignored() -> None:
    """Issue 42: `rollout.tools: [{name: search, timeout_s: 3}]` was accepted and its limits
    silently ignored (search reads orchestrator.search)."""
    from pydantic import ValidationError

    from orchestrator.config import OrchestratorConfig

    for entry_ in ({"name": "search", "limits": {"timeout_s": 3}}, {"name": "search", "x": 1}):
        with pytest.raises(ValidationError, match=r"orchestrator\.search.*(limits|x)"):
            OrchestratorConfig.model_validate({"rollout": {"tools": [entry_]}})
    cfg = OrchestratorConfig.model_validate({"rollout": {"tools": ["search"]}})
    assert cfg.rollout.tools[0].name == "search"


def test_every_tool_search_and_task_share_one_limits_section_with_their_own_defaults() -> None:
    """Issue 42: `SearchConfig`, `ToolConfig` and `TaskConfig` repeated the runner's limit
    fields (9 of them, three times). Now one `limits` section; a partial one keeps its owner's
    defaults; the old flat spelling is refused, naming where the field went."""
    from pydantic import ValidationError

    from orchestrator.config import TaskConfig

    cfg = OrchestratorConfig.model_validate(
        {
            "search": {"limits": {"timeout_s": 3}},
            "rollout": {
                "action_format": "function_calling",
                "tools": [{"name": "calculator", "limits": {"max_attempts": 1}}],
            },
            "task": {"name": "guess-number", "limits": {"timeout_s": 7}},
        }
    )
    search, tool, task = cfg.search.limits, cfg.rollout.tools[0].limits, cfg.task.limits  # type: ignore[union-attr]
    assert type(search) is type(tool) is type(task) is CallLimits
    # set fields, then each owner's own defaults for the rest
    assert (search.timeout_s, search.max_attempts, search.breaker_max_wait_s) == (3, 4, 600)
    assert (tool.timeout_s, tool.max_attempts, tool.breaker_max_wait_s) == (10, 1, 60)
    assert (task.timeout_s, task.max_attempts, task.max_concurrency) == (7, 1, 256)
    assert SearchConfig(limits=CallLimits(timeout_s=2)).limits.max_attempts == 4
    with pytest.raises(ValidationError, match=r"timeout_s: set under `limits:`"):
        SearchConfig.model_validate({"timeout_s": 3})
    with pytest.raises(ValidationError, match=r"breaker_failures: set under `limits:`"):
        ToolConfig.model_validate({"name": "calculator", "breaker_failures": 3})
    with pytest.raises(ValidationError, match=r"task\.limits\.max_attempts: .*never retried"):
        TaskConfig.model_validate({"name": "guess-number", "limits": {"max_attempts": 2}})
