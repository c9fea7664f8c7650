"""`searchr1 task list` and `searchr1 task check NAME`: see the tasks, and try one without a model.

`check` loads the task as the orchestrator would (`orchestrator.task`), renders one row with a
tokenizer's chat template, plays the task's scripted demonstration through the real rollout
loop (its environment, deadlines and rubric; a scripted policy instead of an engine), and
prints every token id of the sample with its loss mask, then the reward. A task that cannot be
built fails naming the field, as at start-up.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from engine_client.client import GenerateResult
from orchestrator.config import ActionFormat, RewardConfig, RolloutConfig, SearchConfig, TaskConfig
from orchestrator.formats.environment import EnvTurns
from orchestrator.hooks import HookError
from orchestrator.rollout import Rollout
from orchestrator.sample import Sample, new_group
from orchestrator.scoring import Scorer
from orchestrator.tasks.base import SPLITS, Task
from orchestrator.tasks.registry import BUILTIN_TASKS, load_task, task_rows
from orchestrator.tokenizer import rust_tokenizer
from orchestrator.tools.registry import build_toolbox
from orchestrator.tools.search import SearchTool
from orchestrator.tools.toolbox import Toolbox
from searchr1.dotted import load_object

app = typer.Typer(help="Tasks: the environments to train on (docs/tasks.md).", no_args_is_help=True)


def _fail(msg: str) -> typer.Exit:
    typer.secho(f"error: {msg}", err=True, fg=typer.colors.RED)
    return typer.Exit(2)


@app.command("list")
def list_tasks() -> None:
    """The built-in tasks and adapters (any `pkg.mod:MyTask` path works too)."""
    table = Table("name", "loads", "what it is")
    for name, path in BUILTIN_TASKS.items():
        try:
            what = load_object(path).description
        except (ImportError, AttributeError) as e:  # shown, not fatal: the others still list
            what = f"[red]cannot load: {e}[/red]"
        table.add_row(name, path, what)
    Console().print(table)


class ScriptedPolicy:
    """Stands in for the engine: answers each call with the next scripted message."""

    def __init__(self, tokenizer: Any, messages: list[str]) -> None:
        self.tokenizer, self.messages, self.calls = tokenizer, messages, 0

    async def generate(self, input_ids: list[int], **kw: Any) -> GenerateResult:
        text = self.messages[min(self.calls, len(self.messages) - 1)]
        self.calls += 1
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))[: kw["max_new_tokens"]]
        return GenerateResult(
            text=text,
            output_ids=ids,
            logprobs=[0.0] * len(ids),
            finish_reason="stop",
            matched_stop=None,
            prompt_tokens=len(input_ids),
            completion_tokens=len(ids),
            weight_version=0,
            start_weight_version=0,
        )


class NoRetriever:
    """`task check` runs without services: a tool task's searches fail, visibly."""

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[Any]]:
        raise ConnectionError("no retriever in `searchr1 task check`")

    async def ready(self) -> bool:
        return False


def scripted_rollout(
    task: Task, tokenizer: Any, messages: list[str], max_turns: int, tools: Toolbox | None = None
) -> Rollout:
    """The rollout loop over `task` with a scripted policy playing `messages`. A tool task's
    search has no retriever (it fails at once); its other tools are `tools`' (the task's own:
    `task_toolbox`), none by default."""
    cfg = RolloutConfig(max_turns=max_turns)
    policy = ScriptedPolicy(tokenizer, messages)
    if task.loop_tools is None:
        env = EnvTurns(task, tokenizer, TaskConfig(name=task.name).limits)
        return Rollout(cfg, policy, Toolbox([]), tokenizer, env=env)
    cfg = cfg.model_copy(update={"action_format": task.loop_tools.action_format})
    return Rollout(cfg, policy, tools or offline_search(), tokenizer)


def offline_search() -> SearchTool:
    """Search without a retriever: one attempt, failing at once."""
    limits = {"max_attempts": 1, "timeout_s": 1.0, "breaker_max_wait_s": 1.0}
    return SearchTool(NoRetriever(), SearchConfig(limits=limits))


async def task_toolbox(task: Task) -> Toolbox | None:
    """A function-calling task's tools as it configures them (an MCP server is started),
    search offline; None for other tasks. Close it with `aclose()`."""
    if task.loop_tools is None or task.loop_tools.action_format != ActionFormat.FUNCTION_CALLING:
        return None
    return await build_toolbox(task.loop_tools.tools, offline_search())


def print_sample(tokenizer: Any, s: Sample) -> None:
    table = Table("position", "id", "token", "loss mask", title=f"{s.trajectory_id}: response")
    for i, (tid, mask) in enumerate(zip(s.response_ids, s.loss_mask, strict=True)):
        token = tokenizer.decode([tid], skip_special_tokens=False)
        table.add_row(str(i), str(tid), repr(token), str(mask), style=None if mask else "dim")
    console = Console()
    console.print(table)
    console.print(f"prompt ids ({len(s.prompt_ids)}): {s.prompt_ids}")
    console.print(
        f"status={s.status} turns={len(s.turns)} reward={s.reward} "
        f"components={json.dumps(s.reward_components)} turn_rewards={[t.reward for t in s.turns]}"
    )


@app.command("check")
def check(
    name: Annotated[str, typer.Argument(help="A built-in task or a dotted path pkg.mod:MyTask.")],
    options: Annotated[str, typer.Option(help="The task's options as JSON.")] = "{}",
    tokenizer_path: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer", help="A Hugging Face tokenizer directory (default: a tiny one)."
        ),
    ] = None,
    split: Annotated[str, typer.Option(help="train or eval.")] = "train",
    row: Annotated[int, typer.Option(min=0, help="Which row to play.")] = 0,
    max_turns: Annotated[int, typer.Option(min=1)] = 8,
) -> None:
    """Load NAME, render one row, play its scripted demonstration, print ids and loss masks."""
    if split not in SPLITS:
        raise _fail(f"--split must be one of {', '.join(SPLITS)} (got {split!r})")
    try:
        task = load_task(TaskConfig(name=name, options=json.loads(options)))
        rows = task_rows(task, split)  # type: ignore[arg-type]
    except json.JSONDecodeError as e:
        raise _fail(f"--options: not JSON: {e}") from None
    except HookError as e:
        raise _fail(str(e)) from None
    if row >= len(rows):
        raise _fail(f"--row {row}: the {split} split has {len(rows)} rows")
    prompt = rows[row]
    try:
        messages = task.demonstration(prompt)
    except NotImplementedError as e:
        raise _fail(str(e)) from None
    from transformers import AutoTokenizer  # heavy: only for this command

    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer_path is None:
            from inference.tiny_model import make_tiny_model  # a tokenizer built offline

            tokenizer_path = make_tiny_model(Path(tmp), hidden_size=16, num_layers=1)
        tokenizer = rust_tokenizer(AutoTokenizer.from_pretrained(tokenizer_path))
    typer.echo(f"task {task.name}: {len(rows)} {split} rows; row {prompt.prompt_id}:")
    typer.echo(json.dumps(prompt.messages, indent=1))

    async def play() -> Sample:
        tools = await task_toolbox(task)
        try:
            rollout = scripted_rollout(task, tokenizer, messages, max_turns, tools)
            [sample] = new_group(prompt, rollout.prompt_ids(prompt.messages), group_size=1,
                                 rollout_step=0, run_id="check")  # fmt: skip
            await rollout.run_sample(sample)
            if rollout.env is None:  # a tool task: scored by orchestrator.reward (EM by default)
                await Scorer(RewardConfig()).score_group([sample])
            return sample
        finally:
            if tools is not None:
                await tools.aclose()

    print_sample(tokenizer, asyncio.run(play()))
