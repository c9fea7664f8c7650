"""`searchr1 agent run`'s runner: N sessions per row, each an unmodified openai-client program
on its own base URL; groups published, failures and timeouts dead-lettered and counted."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from typer.testing import CliRunner

from gateway import metrics
from gateway.runner import AgentRunner, load_program, load_reward, load_rows, reward_of
from stack.cli import app as searchr1
from tests.unit.gateway.conftest import EOT


async def test_groups_of_sessions_per_row(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["Paris" + EOT])

    async def agent(base_url: str, row: dict[str, Any]) -> dict[str, float]:
        client = AsyncOpenAI(base_url=base_url, api_key="x", http_client=rig.http())
        r = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": row["question"]}]
        )
        return {"reward": float(r.choices[0].message.content == row["answer"]), "calls": 1.0}

    rows = [
        {"id": "r0", "question": "capital?", "answer": "Paris"},
        {"question": "q", "answer": "x"},
    ]
    runner = AgentRunner("http://gateway", agent, samples_per_row=2, run_id="run", concurrency=3)
    runner.http = rig.http()
    summary = await runner.run(rows)
    await runner.aclose()
    assert summary.counts() == {"rewarded": 4} and summary.mean_reward() == 0.5
    trajs = await rig.published(4)
    assert sorted(t.trajectory_id for t in trajs) == [
        "run.0.0/0",
        "run.0.1/0",
        "run.1.0/0",
        "run.1.1/0",
    ]
    by_group = {t.group_id: (t.group_size, t.prompt_id, t.reward.total) for t in trajs}
    assert by_group == {"run/0": (2, "r0", 1.0), "run/1": (2, "1", 0.0)}
    assert {t.reward.components["calls"] for t in trajs} == {1.0}


async def test_failures_and_timeouts_are_dead_lettered(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["x" + EOT])

    async def agent(base_url: str, row: dict[str, Any]) -> Any:
        client = AsyncOpenAI(base_url=base_url, api_key="x", http_client=rig.http())
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "go"}]
        )
        if row["kind"] == "boom":
            raise RuntimeError("tool crashed")
        if row["kind"] == "slow":
            await asyncio.sleep(30)
        return "no number"

    before = {k: metrics.AGENT_SESSIONS.labels(k)._value.get() for k in metrics.AGENT_OUTCOMES}
    # 5 s: the slow one times out, the others answer in time even on a busy machine
    runner = AgentRunner("http://gateway", agent, timeout_s=5.0, run_id="f")
    runner.http = rig.http()
    rows = [{"kind": "boom"}, {"kind": "slow"}, {"kind": "text"}]
    summary = await runner.run(rows)
    await runner.aclose()
    assert [(s.outcome, s.status) for s in summary.sessions] == [
        ("error", "dead_lettered"),
        ("timeout", "dead_lettered"),
        ("no_reward", "dead_lettered"),
    ]
    assert "tool crashed" in summary.sessions[0].error
    after = {k: metrics.AGENT_SESSIONS.labels(k)._value.get() for k in metrics.AGENT_OUTCOMES}
    assert {k: after[k] - before[k] for k in after} == {
        "rewarded": 0,
        "error": 1,
        "timeout": 1,
        "no_reward": 1,
        "rubric_error": 0,
    }
    dead = await rig.dead()
    assert sorted(d["tid"] for d in dead) == [b"f.0.0/0", b"f.1.0/0", b"f.2.0/0"]
    assert {d["reason"] for d in dead} == {b"no_reward"}
    assert await rig.published(1) == []


async def test_a_reward_function_scores_the_result(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["42" + EOT])

    async def agent(base_url: str, row: dict[str, Any]) -> str:
        client = AsyncOpenAI(base_url=base_url, api_key="x", http_client=rig.http())
        r = await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "n?"}]
        )
        return r.choices[0].message.content or ""

    async def exact(row: dict[str, Any], answer: str) -> float:
        return float(answer == row["gold"])

    runner = AgentRunner("http://gateway", agent, reward=exact, run_id="rf")
    runner.http = rig.http()
    summary = await runner.run([{"gold": "42"}])
    await runner.aclose()
    assert summary.sessions[0].reward == 1.0


def test_programs_and_rewards_are_checked_at_start(tmp_path: Path) -> None:
    f = tmp_path / "prog.py"
    f.write_text(
        "async def agent(base_url, row):\n    return 1\n"
        "def sync_agent(base_url, row):\n    return 1\n"
        "async def one_arg(base_url):\n    return 1\n"
        "def score(row, result):\n    return 1\n"
    )
    assert load_program(f"{f}:agent").__name__ == "agent"
    with pytest.raises(ValueError, match="async function"):
        load_program(f"{f}:sync_agent")
    with pytest.raises(ValueError, match="2 positional arguments"):
        load_program(f"{f}:one_arg")
    assert load_reward(f"{f}:score").__name__ == "score"


def test_rows_and_rewards_of_results(tmp_path: Path) -> None:
    jl = tmp_path / "rows.jsonl"
    jl.write_text('{"q": 1}\n\n{"q": 2}\n{"q": 3}\n')
    assert load_rows(jl, limit=2) == [{"q": 1}, {"q": 2}]
    js = tmp_path / "rows.json"
    js.write_text('[{"q": 1}]')
    assert load_rows(js) == [{"q": 1}]
    js.write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_rows(js)
    assert reward_of(1) == (1.0, {})
    assert reward_of(True) == (1.0, {})
    assert reward_of({"reward": 0.5, "em": 1, "note": "x"}) == (0.5, {"em": 1.0})
    assert reward_of(float("nan")) == (None, {})
    assert reward_of("text") == (None, {})


def test_cli_refuses_a_program_it_cannot_load(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("{}\n")
    result = CliRunner().invoke(
        searchr1, ["agent", "run", "--program", "no_such_module_xyz:agent", "--data", str(rows)]
    )
    assert result.exit_code == 2
    assert "no_such_module_xyz" in result.output
