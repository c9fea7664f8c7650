"""The demo's multi-tool task: the years world and its rows, the warm start's demonstrations
(token-exact with the function-calling rollout), the reward on hand-made responses, and the
stack settings."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from demos import multitool as mt
from demos.run import CONFIG_TEMPLATE
from demos.warmstart import WarmStartConfig
from orchestrator.config import OrchestratorConfig, RolloutConfig, SearchConfig, ToolConfig
from orchestrator.data import load_prompts
from orchestrator.rewards import components
from orchestrator.rollout import Rollout
from orchestrator.rollout_log import mask_runs
from orchestrator.sample import Prompt, Status, new_group
from orchestrator.tasks.multi_tool import CALCULATOR_SERVER
from orchestrator.tokenizer import rust_tokenizer
from orchestrator.tools.registry import build_toolbox
from orchestrator.tools.search import SearchTool
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_rollout import Hit

PASSAGE = re.compile(r'Doc 1\(Title: "(\w+)"\) (.*?)\n')


def test_the_world_is_deterministic_and_its_answers_are_the_differences() -> None:
    world = mt.generate_years_world(3, n_people=50, n_questions=80)
    assert world == mt.generate_years_world(3, n_people=50, n_questions=80)
    assert world != mt.generate_years_world(4, n_people=50, n_questions=80)
    year = {p.name: p.year for p in world.people}
    assert all(mt.YEARS[0] <= y <= mt.YEARS[1] for y in year.values())
    assert len(set(year)) == 50 and len(world.questions) == 80
    pairs = set()
    for q in world.questions:
        later, earlier = re.findall(r'"(\w+)"', q.question)
        pairs.add((later, earlier))
        assert q.answers == [str(year[later] - year[earlier])] and int(q.answers[0]) > 0
    assert len(pairs) == 80  # no question twice
    assert {q.split for q in world.questions} == {"train", "test"}
    rows = world.corpus_rows()
    assert len(rows) == 50 and rows[0]["contents"].startswith(f'"{world.people[0].name}"\n')
    assert f"born in {world.people[0].year}." in rows[0]["contents"]
    with pytest.raises(ValueError):
        mt.generate_years_world(0, n_people=1)


def test_rows_load_as_prompts_with_the_answer_format(tmp_path: Path) -> None:
    world = mt.generate_years_world(0, n_people=40, n_questions=40)
    paths = mt.write_years_world(world, tmp_path)
    assert len(paths["corpus"].read_text().splitlines()) == 40
    prompts = load_prompts(paths["test"])
    test = world.split("test")
    assert len(prompts) == len(test) > 0
    assert prompts[0].golds == test[0].answers
    assert prompts[0].data_source == mt.DATA_SOURCE
    content = prompts[0].messages[0]["content"]
    assert "<answer> and </answer>" in content and test[0].question in content


@pytest.mark.parametrize(
    ("response", "em"),
    [
        (
            '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1997 - 1908"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>tool\n89<|im_end|>\n<|im_start|>assistant\n"
            "<answer> 89 </answer><|im_end|>",
            1.0,
        ),
        ("<answer> 89 </answer><|im_end|>", 1.0),  # a right guess counts
        ("<answer> 88 </answer><|im_end|>", 0.0),
        # SQuAD's normalization drops punctuation, a minus sign included: "years apart" is
        # the same either way round
        ("<answer> -89 </answer><|im_end|>", 1.0),
        ("<|im_start|>tool\n89<|im_end|>\n", 0.0),  # the result read but never answered
        ("<answer> 12 </answer> then <answer> 89 </answer>", 1.0),  # the last answer counts
    ],
)
def test_the_reward_reads_the_last_answer_of_the_response(response: str, em: float) -> None:
    assert components(response, ["89"])["em"] == em


def test_the_stack_settings_name_both_tools_in_the_function_calling_format() -> None:
    data = yaml.safe_load(CONFIG_TEMPLATE.read_text())
    calc, name = mt.calculator_tool_config()
    mt.apply_to_stack_config(data, calc)
    cfg = OrchestratorConfig.model_validate(data["orchestrator"])
    assert cfg.rollout.action_format == "function_calling"
    assert [t.name for t in cfg.rollout.tools] == ["search", calc["name"]]
    assert cfg.reward.function == "em"
    # mcp-server-calculator is installed with the dev dependencies: the demo uses it
    assert name == mt.MCP_CALCULATOR and calc["mcp"]["include"] == [mt.MCP_CALCULATOR]
    assert Path(calc["mcp"]["command"][0]).name == CALCULATOR_SERVER


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class _Retriever:
    """Returns the passage the demonstration showed for each name."""

    def __init__(self, passages: dict[str, str]) -> None:
        self.passages = passages

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[Any]]:
        return [[Hit("1", self.passages[q])] for q in queries]


async def _rollout_of(demo: Any, tokenizer: Any) -> Any:
    """The function-calling rollout of the demo's model turns, with the built-in calculator
    and a retriever that knows the demo's passages."""
    text = tokenizer.decode(demo.response_ids)
    passages = {m[0]: f'"{m[0]}"\n{m[1]}' for m in PASSAGE.findall(text)}
    turns = [
        tokenizer.decode(demo.response_ids[a:b])
        for value, a, b in mask_runs(bytes(demo.loss_mask))
        if value
    ]
    tools = [ToolConfig.model_validate(t) for t in ("search", "calculator")]
    cfg = RolloutConfig(tools=tools, action_format="function_calling", max_turns=3)
    search = SearchTool(_Retriever(passages), SearchConfig(topk=1, limits=dict(max_attempts=1)))
    rollout = Rollout(cfg, ScriptedEngine(tokenizer, turns), await build_toolbox(tools, search),
                      rust_tokenizer(tokenizer))  # fmt: skip
    content = tokenizer.decode(demo.prompt_ids).split("<|im_start|>user\n", 1)[1]
    content = content.split("<|im_end|>", 1)[0]
    prompt = Prompt("p/0", "synthetic_years", [{"role": "user", "content": content}], ["1"])
    [s] = new_group(prompt, [], group_size=1, rollout_step=0, run_id="r")
    await rollout.run_sample(s)
    return s


async def test_demonstrations_are_token_exact_with_the_rollout(tokenizer) -> None:  # type: ignore[no-untyped-def]
    world = mt.generate_years_world(0, n_people=30, n_questions=30)
    sampler = mt.MultiToolSampler(world, tokenizer, WarmStartConfig(topk=1), "calculator")
    rng = random.Random(0)
    for searched in itertools.islice(itertools.cycle([True, False]), 6):
        demo = sampler.sample(rng, searched=searched)
        s = await _rollout_of(demo, tokenizer)
        assert s.status == Status.ANSWERED
        assert s.prompt_ids == demo.prompt_ids
        assert s.response_ids == demo.response_ids
        assert s.loss_mask == demo.loss_mask
        answer = f"<answer> {demo.answer} </answer>"
        if not searched:
            assert [t.action for t in s.turns] == ["answer"]
            continue
        assert answer in s.response_text
        assert [t.action for t in s.turns] == ["tool", "tool", "answer"]
        # each call, its arguments and its result on the turn record
        searches, [calc] = s.turns[0].tool_calls, s.turns[1].tool_calls
        assert [c.name for c in searches] == ["search", "search"]
        names = [json.loads(c.arguments_json)["query"] for c in searches]
        assert all(f'(Title: "{n}")' in c.result for n, c in zip(names, searches, strict=True))
        assert calc.name == "calculator" and calc.result == demo.answer and not calc.error
        assert calc.attempts == 1 and " - " in json.loads(calc.arguments_json)["expression"]


def test_demonstrations_mix_tool_use_and_guesses(tokenizer) -> None:  # type: ignore[no-untyped-def]
    world = mt.generate_years_world(0, n_people=30, n_questions=30)
    sampler = mt.MultiToolSampler(world, tokenizer, WarmStartConfig(topk=1), "calculate")
    phase = mt.warm_start_config(0, 1).phases()[-1]
    batch = next(sampler.batches(phase, random.Random(0)))
    assert 0 < sum(d.searched for d in batch) < len(batch)
    shown = " ".join(tokenizer.decode(d.response_ids) for d in batch)
    # random facts only: no passage of the world is ever shown
    for p in world.people:
        assert f"{p.name} is a {p.profession} who was born in {p.year}." not in shown


def test_tool_calls_per_question_counts_each_call(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    calls = [{"name": "search"}, {"name": "search"}]
    rows = [
        {
            "turns": [
                {"action": "tool", "query": json.dumps(calls)},
                {"action": "tool", "query": json.dumps([{"name": "calculate"}])},
                {"action": "answer", "query": ""},
            ]
        },
        {"turns": [{"action": "answer", "query": ""}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "e.parquet")
    got = mt.tool_calls_per_question(tmp_path / "e.parquet")
    assert got == {"calculate": 0.5, "search": 1.0}


def test_an_unknown_task_exits_2_before_any_work(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stack import cli

    result = CliRunner().invoke(
        cli.app, ["demo", "--quick", "--out", str(tmp_path / "o"), "--task", "chess"]
    )
    assert result.exit_code == 2
    assert "--task must be one of search-r1, multi-tool, guess-number" in result.output
    assert not (tmp_path / "o").exists()


def test_the_task_reaches_the_stack_config_and_search_r1_is_untouched(tmp_path: Path) -> None:
    from demos.run import DemoConfig, write_stack_config
    from stack.config import load_config

    rows = {}
    for split in ("train", "test"):
        rows[split] = tmp_path / f"{split}.jsonl"
        rows[split].write_text('{"q": 1}\n' * 40)
    calc, _ = mt.calculator_tool_config()
    out = {}
    for task in ("search-r1", "multi-tool"):
        cfg = DemoConfig.quick_mode(tmp_path / task, task=task)
        cfg.out_dir.mkdir()
        edit = (lambda d: mt.apply_to_stack_config(d, calc)) if task == "multi-tool" else None
        out[task] = load_config(write_stack_config(cfg, tmp_path / "i", tmp_path / "m", rows,
                                                   edit)).orchestrator.rollout  # fmt: skip
    assert out["search-r1"].action_format == "search_r1"
    assert [t.name for t in out["search-r1"].tools] == ["search"]
    assert out["multi-tool"].action_format == "function_calling"
    assert [t.name for t in out["multi-tool"].tools] == ["search", "calc"]


def test_the_summary_shows_calculator_calls_only_for_the_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from demos import cli as demo_cli

    demo_cli.print_demo_summary({"em_before": 0.1}, tmp_path, "torch", "hf")
    assert "calculator calls" not in capsys.readouterr().out
    result = {"em_before": 0.1, "calculator_calls_per_question": 1.0}
    demo_cli.print_demo_summary(result, tmp_path, "torch", "hf")
    assert "calculator calls / question" in capsys.readouterr().out


def test_without_the_mcp_calculator_the_task_refuses_to_start_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to fall back to the built-in calculator, silently."""
    from typer.testing import CliRunner

    from orchestrator.config import TaskConfig
    from orchestrator.hooks import HookError
    from orchestrator.tasks import multi_tool
    from orchestrator.tasks.registry import load_task
    from stack import cli

    monkeypatch.setattr(multi_tool.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(multi_tool.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="mcp-server-calculator"):
        mt.calculator_tool_config()
    task = TaskConfig(name="multi-tool", options={"train_path": str(tmp_path / "t.jsonl")})
    with pytest.raises(HookError, match=r"orchestrator\.task\.options.*mcp-server-calculator"):
        load_task(task)
    out = tmp_path / "o"
    result = CliRunner().invoke(
        cli.app, ["demo", "--quick", "--out", str(out), "--task", "multi-tool"]
    )
    assert result.exit_code == 2 and "mcp-server-calculator" in result.output
    assert not out.exists()


def test_multi_tool_is_a_built_in_task_that_serves_search_and_the_mcp_calculator(
    tmp_path: Path, tokenizer: Any
) -> None:
    """Issue 42: the multi-tool task lived only in the demo; now it is a built-in Task: its
    rows, its tools (search + the MCP calculator) in function calling, a demonstration that
    `searchr1 task check multi-tool` plays."""
    import asyncio

    from orchestrator.config import TaskConfig
    from orchestrator.tasks.registry import load_task
    from stack.task_cli import scripted_rollout, task_toolbox

    paths = mt.write_years_world(mt.generate_years_world(0, n_people=20, n_questions=30), tmp_path)
    options = {"train_path": str(paths["train"]), "val_path": str(paths["test"])}
    task = load_task(TaskConfig(name="multi-tool", options=options))
    assert task.loop_tools is not None and task.loop_tools.action_format == "function_calling"
    search, calc = task.loop_tools.tools
    assert search.name == "search" and calc.mcp is not None
    assert Path(calc.mcp.command[0]).name == CALCULATOR_SERVER
    assert calc.mcp.include == [mt.MCP_CALCULATOR]
    prompt = task.rows("train")[0]
    assert task.rows("eval") and prompt.golds
    messages = task.demonstration(prompt)
    assert len(messages) == 3 and f"<answer> {prompt.golds[0]} </answer>" == messages[-1]

    async def play() -> Any:
        tools = await task_toolbox(task)  # the real MCP calculator; search without a retriever
        assert tools is not None and tools.names == ["search", mt.MCP_CALCULATOR]
        try:
            rollout = scripted_rollout(task, rust_tokenizer(tokenizer), messages, 3, tools)
            [sample] = new_group(prompt, rollout.prompt_ids(prompt.messages), group_size=1,
                                 rollout_step=0, run_id="t")  # fmt: skip
            return await rollout.run_sample(sample)
        finally:
            await tools.aclose()

    sample = asyncio.run(play())
    assert [t.action for t in sample.turns] == ["tool", "tool", "answer"]
    assert sample.status == Status.ANSWERED
    assert sample.turns[1].tool_calls[0].result == prompt.golds[0]  # the calculator answered
