"""The search-r1 task is today's loop, token for token: the ids and loss masks of a scripted
Search-R1 episode through the task (`orchestrator.task: search-r1`, the path the orchestrator
builds) equal those recorded from the loop before tasks existed (golden/, written by the code
at 6f19dd5 with the same tokenizer, engine script and retriever)."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.config import OrchestratorConfig, SearchConfig, TaskConfig
from orchestrator.data import write_parquet
from orchestrator.prompt import make_row
from orchestrator.rollout import Rollout
from orchestrator.sample import new_group
from orchestrator.tasks.registry import load_task
from orchestrator.tokenizer import rust_tokenizer
from orchestrator.tools.registry import build_toolbox
from orchestrator.tools.search import SearchTool
from orchestrator.wiring import rollout_settings, training_prompts
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_rollout import FakeRetriever

GOLDEN = Path(__file__).parent / "golden" / "search_r1_trajectory.json"
TURNS = [
    "<think> who wrote it </think>\n<search> author of the book </search>",
    "<think> more </think>\n<search> Paris France </search>",
    "<think> done </think>\n<answer> Paris </answer>",
]


async def test_the_search_r1_task_gives_the_ids_of_the_loop_before_tasks(
    tokenizer, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    row = make_row(
        "what is the capital of france", ["Paris"], data_source="nq", split="train", index=0
    )
    write_parquet([row], tmp_path / "train.parquet")
    task_cfg = TaskConfig(name="search-r1", options={"train_path": str(tmp_path / "train.parquet")})
    cfg = OrchestratorConfig(task=task_cfg)
    cfg.rollout.max_turns = 3
    task = load_task(task_cfg)
    [prompt] = training_prompts(cfg, task)
    cfg = rollout_settings(cfg, task)  # what connect_rollout does with a tool task
    tools = await build_toolbox(cfg.rollout.tools, SearchTool(FakeRetriever(), SearchConfig()))
    engine = ScriptedEngine(tokenizer, TURNS)
    rollout = Rollout(cfg.rollout, engine, tools, rust_tokenizer(tokenizer))
    [s] = new_group(
        prompt, rollout.prompt_ids(prompt.messages), group_size=1, rollout_step=0, run_id="g"
    )
    await rollout.run_sample(s)
    golden = json.loads(GOLDEN.read_text())
    assert s.prompt_ids == golden["prompt_ids"]
    assert s.response_ids == golden["response_ids"]
    assert s.loss_mask == golden["loss_mask"]
    assert str(s.status) == golden["status"] == "answered"
