"""`searchr1 agent run --task`: the task's rows, and its rubric scoring a session whose program
returns None, on the ids the policy generated as the gateway recorded them; a rubric that
raises dead-letters the session (counted); a task that cannot be loaded is a CLI error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from openai import AsyncOpenAI
from typer.testing import CliRunner

from gateway import metrics
from gateway.config import AgentConfig
from gateway.rubric import TaskRubric
from gateway.runner import AgentRunner, RunSummary
from orchestrator.config import ActionFormat, ToolConfig
from orchestrator.sample import Prompt, Sample
from orchestrator.tasks.base import Episode, LoopTools, Split, Task
from searchr1.redis_server import free_port
from stack.cli import app as searchr1
from tests.unit.gateway.conftest import EOT

HERE = "tests.unit.gateway.test_task_rubric"


class Capitals(Task):
    """A single-turn QA task: the rubric rewards the right capital in `<answer>`."""

    name = "capitals"

    def rows(self, split: Split) -> list[Prompt]:
        return [
            Prompt(f"capitals/{split}/{i}", "capitals", [{"role": "user", "content": q}], [gold])
            for i, (q, gold) in enumerate([("Capital of France?", "Paris"), ("Of Italy?", "Rome")])
        ]

    def score(self, sample: Sample, episode: Episode) -> dict[str, float]:
        right = f"<answer> {sample.golds[0]} </answer>" in sample.response_text
        return {"reward": float(right), "right": float(right)}


class SearchCapitals(Capitals):
    """The same rows served by the loop's tools: the orchestrator's reward (EM) scores them."""

    loop_tools = LoopTools(ActionFormat.SEARCH_R1, [ToolConfig(name="search")])


class Broken(Capitals):
    def score(self, sample: Sample, episode: Episode) -> dict[str, float]:
        raise KeyError("golds")


class Hung(Capitals):
    async def score(self, sample: Sample, episode: Episode) -> dict[str, float]:  # type: ignore[override]
        await asyncio.sleep(60)  # a judge that never answers
        return {"reward": 1.0}


def answer_once(rig: Any) -> Any:
    """An agent that asks once and leaves the reward to the task."""

    async def agent(base_url: str, row: dict[str, Any]) -> None:
        client = AsyncOpenAI(base_url=base_url, api_key="x", http_client=rig.http())
        await client.chat.completions.create(model="p", messages=row["messages"])

    return agent


async def no_reward(base_url: str, row: dict[str, Any]) -> None:
    """A plain openai-client program that leaves the reward to the task (`agent run`)."""
    client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    await client.chat.completions.create(model="p", messages=row["messages"])


async def run(
    rig: Any, task: TaskRubric, rows: list[dict[str, Any]], agent: Any, timeout_s: float = 600.0
) -> RunSummary:
    runner = AgentRunner(
        "http://gateway", agent, task=task, run_id="t", concurrency=1, timeout_s=timeout_s
    )
    runner.http = rig.http()
    try:
        return await runner.run(rows)
    finally:
        await runner.aclose()


async def test_agent_run_scores_by_the_task(make_rig) -> None:  # type: ignore[no-untyped-def]
    """`searchr1 agent run --task` end to end: the gateway's app on a loopback port, the CLI
    (in a thread: it runs its own event loop) with a program that returns None."""
    rig = make_rig(["<answer> Paris </answer>" + EOT])
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(rig.app, host="127.0.0.1", port=port, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        args = ["agent", "run", "--program", f"{HERE}:no_reward", "--task", f"{HERE}:Capitals"]
        args += ["--gateway-url", f"http://127.0.0.1:{port}", "-n", "1", "--run-id", "cli"]
        result = await asyncio.to_thread(CliRunner().invoke, searchr1, args)
    finally:
        server.should_exit = True
        await serving
    assert result.exit_code == 0, result.output
    assert "sessions=2 rewarded=2 mean_reward=0.5000" in result.output
    trajs = sorted(await rig.published(2), key=lambda t: t.prompt_id)
    assert [(t.prompt_id, t.reward.total) for t in trajs] == [
        ("capitals/train/0", 1.0),
        ("capitals/train/1", 0.0),
    ]


@pytest.mark.parametrize("name", ["Capitals", "SearchCapitals"])
async def test_the_rubric_rewards_the_right_answer_only(make_rig, name: str) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["<answer> Paris </answer>" + EOT])
    task = TaskRubric.load(f"{HERE}:{name}")
    rows = task.rows("train")
    assert rows[0]["question"] == "Capital of France?" and rows[0]["golds"] == ["Paris"]
    summary = await run(rig, task, rows, answer_once(rig))
    assert [(s.outcome, s.reward, s.status) for s in summary.sessions] == [
        ("rewarded", 1.0, "ended"),
        ("rewarded", 0.0, "ended"),
    ]
    trajs = sorted(await rig.published(2), key=lambda t: t.prompt_id)
    assert [(t.prompt_id, t.reward.total) for t in trajs] == [
        ("capitals/train/0", 1.0),
        ("capitals/train/1", 0.0),
    ]
    key = "right" if name == "Capitals" else "em"
    assert [t.reward.components[key] for t in trajs] == [1.0, 0.0]


async def test_an_episode_task_replays_the_policy_messages(make_rig) -> None:  # type: ignore[no-untyped-def]
    """guess-number: each model message (as generated) through a fresh episode, then the
    rubric; the program played the game itself."""
    rig = make_rig(["<guess> 3 </guess>" + EOT, "<guess> 8 </guess>" + EOT])
    task = TaskRubric.load("guess-number", {"high": 16, "train_size": 64})
    rows = task.rows("train")
    right = next(r for r in rows if r["golds"] == ["8"])
    wrong = next(r for r in rows if r["golds"][0] not in ("3", "8"))

    async def two_guesses(base_url: str, row: dict[str, Any]) -> None:
        client = AsyncOpenAI(base_url=base_url, api_key="x", http_client=rig.http())
        messages = list(row["messages"])
        for _ in range(2):
            r = await client.chat.completions.create(model="p", messages=messages)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "no"},
            ]

    summary = await run(rig, task, [right, wrong], two_guesses)
    assert [(s.outcome, s.reward) for s in summary.sessions] == [
        ("rewarded", 1.0),
        ("rewarded", 0.0),
    ]
    trajs = sorted(await rig.published(2), key=lambda t: t.group_id)
    assert [t.reward.components["em"] for t in trajs] == [1.0, 0.0]
    assert [t.reward.components["guesses"] for t in trajs] == [2.0, 2.0]


@pytest.mark.parametrize(("name", "error"), [("Broken", "KeyError"), ("Hung", "within 3.0s")])
async def test_a_rubric_that_fails_dead_letters_the_session(
    make_rig, name: str, error: str
) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["<answer> Paris </answer>" + EOT])
    before = metrics.AGENT_SESSIONS.labels("rubric_error")._value.get()
    task = TaskRubric.load(f"{HERE}:{name}")
    summary = await run(rig, task, task.rows("train")[:1], answer_once(rig), timeout_s=3.0)
    s = summary.sessions[0]
    assert (s.outcome, s.reward, s.status) == ("rubric_error", None, "dead_lettered")
    assert error in s.error
    assert metrics.AGENT_SESSIONS.labels("rubric_error")._value.get() == before + 1
    assert [d["reason"] for d in await rig.dead()] == [b"no_reward"]
    assert await rig.published(1) == []


def test_a_task_that_cannot_be_loaded_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"agent\.task \(--task\).*no-such-task"):
        TaskRubric.load("no-such-task")
    with pytest.raises(ValueError, match=r"--task-options.*unknown options"):
        TaskRubric.load("guess-number", {"hgih": 3})
    assert AgentConfig(task="guess-number").split == "train"
    result = CliRunner().invoke(
        searchr1, ["agent", "run", "--program", f"{HERE}:no_reward", "--task", "no-such-task"]
    )
    assert result.exit_code == 2, result.output
    assert "--task" in result.output and "no-such-task" in result.output
    result = CliRunner().invoke(
        searchr1,
        ["agent", "run", "--program", f"{HERE}:no_reward", "--task", "x", "--task-options", "[1"],
    )
    assert result.exit_code == 2 and "--task-options" in result.output
