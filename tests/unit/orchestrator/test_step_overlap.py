"""Async mode has no step barrier: the next step starts once every group of the previous one
is claimed, while its slowest groups still run; sync mode (and dynamic sampling) keeps it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchestrator.config import OrchestratorConfig
from orchestrator.data import PromptSampler, row_to_prompt
from orchestrator.loop import Orchestrator
from orchestrator.prompt import make_row
from orchestrator.rollout import Rollout
from orchestrator.scoring import Scorer
from orchestrator.tools.search import SearchTool
from searchr1.bus import TrajectoryBus
from searchr1.sections import BusConfig, RunConfig
from tests.unit.orchestrator.conftest import ScriptedEngine, until
from tests.unit.orchestrator.test_loop import drain
from tests.unit.orchestrator.test_rollout import TURN1, TURN2, FakeRetriever

PROMPTS = [
    row_to_prompt(make_row(f"q{i}", ["Paris"], data_source="nq", split="train", index=i), i)
    for i in range(8)
]


class HoldingEngine(ScriptedEngine):
    """Holds the questions in `held` until `release` is set (from their second turn on when
    `hold_later_turns`: the first is made at the version of its start); records every question
    it sees."""

    held: tuple[str, ...] = ()
    hold_later_turns = False
    release: asyncio.Event
    seen: list[str]

    async def generate(self, input_ids: list[int], **kw: Any):  # type: ignore[no-untyped-def]
        _, question = self.tokenizer.decode(input_ids).split("Question: ", 1)
        later_turn = "<information>" in question  # a retrieved passage after the question
        question = question.split("?", 1)[0]
        self.seen.append(question)
        if question in self.held and (later_turn or not self.hold_later_turns):
            await self.release.wait()
        return await super().generate(input_ids, **kw)


def build(tokenizer, bus, engine, *, mode="async", max_steps=2, **over):  # type: ignore[no-untyped-def]
    cfg = OrchestratorConfig.model_validate(
        {"weight_poll_s": 0.02, "mode": mode, "max_staleness": 1, **over}
    )
    run = RunConfig(groups_per_step=2, group_size=2, max_steps=max_steps)
    return Orchestrator(
        cfg,
        run=run,
        rollout=Rollout(cfg.rollout, engine, SearchTool(FakeRetriever(), cfg.search), tokenizer),
        scorer=Scorer(cfg.reward),
        engine=engine,
        bus=bus,
        sampler=PromptSampler(PROMPTS, run.groups_per_step, seed=0),
    )


@pytest.fixture
async def bus(redis_server):  # type: ignore[no-untyped-def]
    b = TrajectoryBus.from_url(redis_server.url, BusConfig())
    yield b
    await b.close()


def questions(orch: Orchestrator, step: int) -> list[str]:
    return [f"q{p.metadata['index']}" for p in orch.sampler.batch(step)]


def holding_engine(tokenizer) -> HoldingEngine:  # type: ignore[no-untyped-def]
    engine = HoldingEngine(tokenizer, [TURN1, TURN2])
    engine.release, engine.seen = asyncio.Event(), []
    return engine


async def test_async_next_step_starts_while_the_last_group_runs(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    engine = holding_engine(tokenizer)
    orch = build(tokenizer, bus, engine)
    engine.held = (questions(orch, 0)[0],)  # step 0's slowest group
    run = asyncio.create_task(orch.run())
    try:
        step1 = set(questions(orch, 1))
        # Step 1's groups run while step 0's held group has not finished (the barrier's gap).
        assert await until(lambda: step1 <= set(engine.seen))
        assert orch.step == 0  # the lowest unfinished step: what a restart resumes
        assert not run.done()
    finally:
        engine.release.set()
    await asyncio.wait_for(run, 20)
    got = await drain(bus)
    ids = [d.trajectory.trajectory_id for d in got]
    assert len(ids) == len(set(ids)) == 8  # both steps' groups, each once
    assert {d.trajectory.rollout_step for d in got} == {0, 1}
    assert orch.step == 2


async def step_1_waits_for_step_0(orch: Orchestrator, engine: HoldingEngine) -> asyncio.Task:  # type: ignore[type-arg]
    """Run `orch` with one of step 0's groups held: step 1 does not start while it is held
    (checked once the other group is done); then release it. Returns the running run."""
    held, other = questions(orch, 0)
    engine.held = (held,)
    run = asyncio.create_task(orch.run())
    try:
        assert await until(lambda: engine.seen.count(other) == 4)  # 2 samples x 2 turns
        await asyncio.sleep(0.3)
        assert not set(questions(orch, 1)) & set(engine.seen)
    finally:
        engine.release.set()
    return run


async def test_async_overlap_counts_the_unfinished_groups_against_staleness(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    # max_staleness 0: step 1 needs the weights trained on step 0, unfinished groups included;
    # counting only published groups would start it from the base weights.
    engine = holding_engine(tokenizer)
    orch = build(tokenizer, bus, engine, max_staleness=0)
    run = await step_1_waits_for_step_0(orch, engine)
    assert await until(lambda: orch.step == 1)
    await asyncio.sleep(0.2)
    assert not set(questions(orch, 1)) & set(engine.seen)  # waits for version 1
    engine.weight_version = 1
    await asyncio.wait_for(run, 20)
    assert len(await drain(bus)) == 8


KEEP_ALL = "tests.unit.orchestrator.hook_examples:keep_all"


@pytest.mark.parametrize("over", [{"mode": "sync"}, {"rollout": {"group_filter": KEEP_ALL}}])
async def test_sync_and_dynamic_sampling_keep_the_barrier(tokenizer, bus, over) -> None:  # type: ignore[no-untyped-def]
    engine = holding_engine(tokenizer)
    orch = build(tokenizer, bus, engine, **over)
    run = await step_1_waits_for_step_0(orch, engine)
    engine.weight_version = 1  # sync: step 1 needs the weights trained on step 0
    await asyncio.wait_for(run, 20)
    assert len(await drain(bus)) == 8


async def test_async_staleness_is_bounded_for_the_batch_a_group_joins(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    # Overlapping steps publish out of order: a slow group of step 1 can publish after step 2's
    # groups and so join trainer batch 2. Made at version 0, it would be trained 2 versions
    # behind with max_staleness 1, though it lags the engine (at version 1) by only 1.
    engine = holding_engine(tokenizer)
    orch = build(tokenizer, bus, engine, max_steps=3)
    held, other = questions(orch, 1)
    engine.held, engine.hold_later_turns = (held,), True
    run = asyncio.create_task(orch.run())
    try:
        assert await until(lambda: engine.seen.count(other) == 4)  # step 1's other group done
        engine.weight_version = 1  # step 2 needs version 1
        step2 = questions(orch, 2)
        assert await until(lambda: all(engine.seen.count(q) == 4 for q in step2))
        await asyncio.sleep(0.3)  # step 2's groups published
    finally:
        engine.release.set()
    await asyncio.wait_for(run, 20)
    got = await drain(bus)
    per_group = orch.run_cfg.group_size
    for index, delivery in enumerate(got):
        batch = index // per_group // orch.run_cfg.groups_per_step  # the trainer's version for it
        assert batch - delivery.trajectory.weight_version <= 1, (index, delivery.trajectory)
