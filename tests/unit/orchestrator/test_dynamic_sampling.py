"""Dynamic sampling: over-sampled steps, a group filter, exactly run.groups_per_step groups
published per step, across processes and restarts (a real Redis)."""

from __future__ import annotations

import asyncio
import json

import pytest

from orchestrator import metrics
from orchestrator.config import OrchestratorConfig, RolloutLogConfig
from orchestrator.data import PromptSampler, row_to_prompt
from orchestrator.group_filter import load_group_filter, reward_std
from orchestrator.hooks import HookError
from orchestrator.loop import Orchestrator
from orchestrator.prompt import make_row
from orchestrator.rollout import Rollout
from orchestrator.rollout_log import RolloutLog
from orchestrator.sample import Prompt, new_group
from orchestrator.scoring import Scorer
from orchestrator.tools.search import SearchTool
from searchr1.bus import TrajectoryBus
from searchr1.sections import BusConfig, RunConfig
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_loop import drain
from tests.unit.orchestrator.test_rollout import TURN1, TURN2, FakeRetriever

PROMPTS = [
    row_to_prompt(make_row(f"q{i}", ["Paris"], data_source="nq", split="train", index=i), i)
    for i in range(16)
]
KEEP_ODD = "tests.unit.orchestrator.hook_examples:keep_odd_prompts"


def build(tokenizer, bus, engine, *, worker="w", max_steps=1, **rollout):  # type: ignore[no-untyped-def]
    cfg = OrchestratorConfig.model_validate(
        {"weight_poll_s": 0.02, "mode": "async", "max_staleness": 10, "rollout": rollout,
         "partition": {"worker_id": worker}}
    )  # fmt: skip
    run = RunConfig(groups_per_step=2, group_size=2, max_steps=max_steps)
    return Orchestrator(
        cfg,
        run=run,
        rollout=Rollout(cfg.rollout, engine, SearchTool(FakeRetriever(), cfg.search), tokenizer),
        scorer=Scorer(cfg.reward),
        engine=engine,
        bus=bus,
        sampler=PromptSampler(PROMPTS, run.groups_per_step + cfg.rollout.over_sampling, seed=0),
    )


@pytest.fixture
async def bus(redis_server):  # type: ignore[no-untyped-def]
    b = TrajectoryBus.from_url(redis_server.url, BusConfig())
    yield b
    await b.close()


def groups_of(deliveries: list) -> dict[str, int]:  # type: ignore[type-arg]
    out: dict[str, int] = {}
    for d in deliveries:
        out[d.trajectory.group_id] = out.get(d.trajectory.group_id, 0) + 1
    return out


def skipped(reason: str) -> float:
    return metrics.GROUPS_SKIPPED.labels(reason)._value.get()


def test_reward_std_keeps_groups_whose_rewards_differ() -> None:
    prompt = Prompt(prompt_id="p", data_source="nq", messages=[], golds=["x"])
    group = new_group(prompt, [1, 2], group_size=3, rollout_step=0, run_id="r")
    for s, r in zip(group, [1.0, 1.0, 1.0], strict=True):
        s.reward = r
    assert not reward_std(group)  # advantage 0 everywhere: nothing to learn
    group[1].reward = 0.0
    assert reward_std(group)


def test_filters_load_by_name_or_dotted_path_and_fail_at_start_up() -> None:
    assert load_group_filter(None) is None
    assert load_group_filter("reward_std") is reward_std
    assert load_group_filter(KEEP_ODD).__name__ == "keep_odd_prompts"  # type: ignore[union-attr]
    with pytest.raises(HookError, match=r"rollout\.group_filter"):
        load_group_filter("tests.unit.orchestrator.hook_examples:no_such_filter")
    with pytest.raises(HookError, match=r"rollout\.group_filter"):
        load_group_filter("tests.unit.orchestrator.hook_examples:two_args")


async def test_filtered_groups_are_never_published_and_the_step_still_fills(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2])
    before = skipped("filtered")
    orch = build(tokenizer, bus, engine, over_sampling=2, group_filter=KEEP_ODD)
    await orch.run()
    published = groups_of(await drain(bus))
    # 4 groups started, the 2 of even prompts filtered: exactly groups_per_step published.
    assert len(published) == 2 and set(published.values()) == {2}  # the trainer's 2, no more
    assert all(int(g.rsplit("/", 1)[-1]) % 2 == 1 for g in published)  # prompt ids are indexes
    assert skipped("filtered") - before >= 2


async def test_over_sampling_publishes_exactly_groups_per_step(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2])
    before = skipped("surplus")
    orch = build(tokenizer, bus, engine, over_sampling=3, max_steps=2)
    await orch.run()
    got = await drain(bus)
    per_step: dict[int, set[str]] = {}
    for d in got:
        per_step.setdefault(d.trajectory.rollout_step, set()).add(d.trajectory.group_id)
    assert {k: len(v) for k, v in per_step.items()} == {0: 2, 1: 2}
    assert skipped("surplus") - before == 6  # 5 groups per step, 2 kept: 3 surplus each


async def test_a_short_step_is_completed_by_the_next(tokenizer, bus, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The filter keeps the odd prompts only: with over_sampling 1 a step starts 3 groups and
    # may keep fewer than 2; the next step completes the batch, and the run goes on until the
    # trainer's 2 x 2 groups are out (no more: the last batch is not overfilled).
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2])
    orch = build(tokenizer, bus, engine, over_sampling=1, group_filter=KEEP_ODD, max_steps=2)
    orch.rollout_log = RolloutLog(RolloutLogConfig(run_dir=str(tmp_path)), tokenizer)
    await orch.run()
    got = await drain(bus)
    assert len(groups_of(got)) == 4  # exactly the trainer's 2 x 2
    assert orch.step > 2  # a step fell short (the seed-0 order), and a third completed it
    # A step starts what it may publish plus the over-sampling: after a step that published
    # one group, the next starts 1 + 1 groups, not 2 + 1.
    published = 0
    for line in (tmp_path / "rollouts" / "steps.jsonl").open():
        groups = json.loads(line)["groups"]
        assert len(groups) == (2 - published % 2) + 1
        published += sum(g["outcome"] == "published" for g in groups)


async def test_several_processes_share_the_slots(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    engines = [ScriptedEngine(tokenizer, [TURN1, TURN2]) for _ in range(3)]
    orchs = [
        build(tokenizer, bus, e, worker=f"w{i}", over_sampling=4, max_steps=2)
        for i, e in enumerate(engines)
    ]
    await asyncio.gather(*(o.run() for o in orchs))
    got = await drain(bus)
    per_step: dict[int, set[str]] = {}
    for d in got:
        per_step.setdefault(d.trajectory.rollout_step, set()).add(d.trajectory.group_id)
    assert {k: len(v) for k, v in per_step.items()} == {0: 2, 1: 2}
    ids = [d.trajectory.trajectory_id for d in got]
    assert len(ids) == len(set(ids)) == 8  # nothing twice


async def test_a_slot_is_the_groups_own_across_a_restart(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    orch = build(tokenizer, bus, ScriptedEngine(tokenizer, [TURN1, TURN2]), over_sampling=1)
    m = orch.markers
    assert await m.take_slot(0, "g0", 2) and await m.take_slot(0, "g1", 2)
    assert not await m.take_slot(0, "g2", 2)  # the step is full
    assert await m.take_slot(0, "g0", 2)  # g0 re-run after a crash: its slot is still its own
    assert await m.slots_taken(0) == 2 and await m.take_slot(1, "g2", 2)


async def test_filtered_groups_stay_in_the_rollout_log(tokenizer, bus, tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2])
    orch = build(tokenizer, bus, engine, over_sampling=2, group_filter=KEEP_ODD)
    orch.rollout_log = RolloutLog(RolloutLogConfig(run_dir=str(tmp_path)), tokenizer)
    await orch.run()
    records = [json.loads(line) for line in (tmp_path / "rollouts" / "steps.jsonl").open()]
    outcomes = {g["group_id"]: g["outcome"] for r in records for g in r["groups"]}
    even = {g for g in outcomes if int(g.rsplit("/", 1)[-1]) % 2 == 0}
    assert even and all(outcomes[g] == "filtered" for g in even)
    assert sum(o == "published" for o in outcomes.values()) == 2


class SlowPromptsEngine(ScriptedEngine):
    """Answers at once, except for the questions in `slow`: those hang."""

    slow: tuple[str, ...] = ()
    hung: int = 0

    async def generate(self, input_ids, **kw):  # type: ignore[no-untyped-def]
        text = self.tokenizer.decode(input_ids)
        if any(f"Question: {q}?" in text for q in self.slow):
            self.hung += 1
            await asyncio.sleep(60)
        return await super().generate(input_ids, **kw)


async def test_a_full_step_stops_its_slowest_groups(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    # Over-sampling's point: the step ends with its last needed group, not its slowest one.
    engine = SlowPromptsEngine(tokenizer, [TURN1, TURN2])
    orch = build(tokenizer, bus, engine, over_sampling=2)
    engine.slow = tuple(f"q{p.metadata['index']}" for p in orch.sampler.batch(0)[:2])
    before = skipped("surplus")
    await asyncio.wait_for(orch.run(), 20)  # the slow groups would take 60 s
    published = groups_of(await drain(bus))
    # At least one slow group was running when the step filled, and was stopped (the other
    # may not have been started by then: under load the fast groups can fill the step first).
    assert engine.hung >= 2
    assert len(published) == 2 and skipped("surplus") - before == 2
    assert orch.last_summary["groups_surplus"] == 2


async def test_data_running_out_ends_the_bus_so_the_trainer_stops_waiting(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    # A filter that rejects every group: nothing is published, the data runs out, and the
    # trainer (waiting for its first batch) must learn that nothing more is coming.
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2])
    reject = "tests.unit.orchestrator.hook_examples:reject_all"
    orch = build(tokenizer, bus, engine, group_filter=reject)
    await asyncio.wait_for(orch.run(), 30)
    reason = await bus.ended()
    assert reason is not None and "ran out" in reason and "0 of 2 groups" in reason
    await orch.forget()  # `--fresh`: a new run on the stream may publish again
    assert await bus.ended() is None
