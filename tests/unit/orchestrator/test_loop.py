"""The step loop against a real Redis bus: sync gating, staleness, restart without duplicates."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator import metrics
from orchestrator.config import OrchestratorConfig
from orchestrator.data import PromptSampler, row_to_prompt
from orchestrator.loop import Orchestrator, StepState, WeightsNotPushed
from orchestrator.markers import RunIdInUse
from orchestrator.prompt import make_row, prompt_token_ids
from orchestrator.rollout import Rollout
from orchestrator.sample import Status
from orchestrator.scoring import Scorer
from orchestrator.tools.search import SearchTool
from searchr1.bus import TrajectoryBus
from searchr1.sections import BusConfig, RunConfig
from tests.unit.orchestrator.conftest import ScriptedEngine, until
from tests.unit.orchestrator.test_rollout import TURN1, TURN2, FakeRetriever

PROMPTS = [
    row_to_prompt(make_row(f"q{i}", ["Paris"], data_source="nq", split="train", index=i), i)
    for i in range(4)
]


def build(tokenizer, bus, engine, validation=None, max_steps=None, **over):  # type: ignore[no-untyped-def]
    cfg = OrchestratorConfig.model_validate({"weight_poll_s": 0.02, **over})
    rollout = Rollout(cfg.rollout, engine, SearchTool(FakeRetriever(), cfg.search), tokenizer)
    sampler = PromptSampler(PROMPTS, 2, seed=0, epochs=1)
    return Orchestrator(
        cfg,
        run=RunConfig(groups_per_step=2, group_size=2, max_steps=max_steps),
        validation=validation,
        rollout=rollout,
        scorer=Scorer(cfg.reward),
        engine=engine,
        bus=bus,
        sampler=sampler,
    )


@pytest.fixture
async def bus(redis_server):  # type: ignore[no-untyped-def]
    b = TrajectoryBus.from_url(redis_server.url, BusConfig())
    yield b
    await b.close()


async def drain(bus: TrajectoryBus) -> list:  # type: ignore[type-arg]
    out = []
    while batch := await bus.consume(100, block=0.05):
        out += batch
    return out


async def test_sync_mode_waits_for_the_next_weights(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2], weight_version=5)
    orch = build(tokenizer, bus, engine)
    task = asyncio.create_task(orch.run())
    assert await until(lambda: orch.step == 1)
    assert not task.done()  # step 1 needs version 6
    first = await drain(bus)
    assert len(first) == 4 and {d.trajectory.weight_version for d in first} == {5}
    engine.weight_version = 6  # "the trainer pushed new weights"
    await asyncio.wait_for(task, 5)
    second = await drain(bus)
    assert len(second) == 4 and {d.trajectory.weight_version for d in second} == {6}
    assert {d.trajectory.rollout_step for d in second} == {1}
    t = second[0].trajectory
    assert t.reward.total == 1.0 and t.reward.components["em"] == 1.0
    groups = {d.trajectory.group_id for d in first + second}
    assert len(groups) == 4


async def test_waiting_for_weights_has_a_deadline(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    """No trainer ever pushes version 6: the wait ends after `weight_wait_s` with an error
    naming both versions (the service turns it into /ready red and exit 1), and the wait is
    visible meanwhile as a gauge."""
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2], weight_version=5)
    orch = build(tokenizer, bus, engine, weight_wait_s=0.6)
    task = asyncio.create_task(orch.run())
    assert await until(lambda: orch.step == 1)
    assert await until(lambda: metrics.WEIGHT_WAIT._value.get() > 0)  # set as the wait starts
    assert not task.done()
    with pytest.raises(WeightsNotPushed, match=r"version 6.*serves 5"):
        await asyncio.wait_for(task, 5)
    assert metrics.WEIGHT_WAIT._value.get() == 0


async def test_restart_does_not_publish_twice(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2])
    orch = build(tokenizer, bus, engine, mode="async", max_steps=1)
    await orch.run()
    # A crash after publishing one group of step 1 but before finishing the step:
    orch2 = build(tokenizer, bus, engine, mode="async")
    await orch2.restore()
    await orch2._run_group(StepState(1, version=0, slots=2), orch2.sampler.batch(1)[0])
    before = metrics.GROUPS_SKIPPED.labels("already_published")._value.get()
    orch3 = build(tokenizer, bus, engine, mode="async")
    await orch3.run()
    assert orch3.step == 2
    assert metrics.GROUPS_SKIPPED.labels("already_published")._value.get() == before + 1
    got = await drain(bus)
    ids = [d.trajectory.trajectory_id for d in got]
    assert len(ids) == len(set(ids)) == 8


class BumpingEngine(ScriptedEngine):
    """Weights move on after every generate call, `bumps` times: a fast trainer."""

    bumps: int = 0

    async def generate(self, input_ids, **kw):  # type: ignore[no-untyped-def]
        r = await super().generate(input_ids, **kw)
        if self.bumps > 0:
            self.bumps -= 1
            self.weight_version += 1
        return r


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
async def test_async_staleness_bound(tokenizer, bus, policy: str) -> None:  # type: ignore[no-untyped-def]
    engine = BumpingEngine(tokenizer, [TURN1, TURN2])
    engine.bumps = 4  # step 0: 2 groups x 2 samples x 2 turns = 8 calls; the first 4 bump
    orch = build(
        tokenizer, bus, engine, mode="async", max_staleness=1, stale_policy=policy, max_steps=1
    )
    stale_before = metrics.GROUPS_SKIPPED.labels("stale")._value.get()
    regen_before = metrics.STALE_REGENERATED._value.get()
    await orch.run()
    got = await drain(bus)
    for d in got:  # whatever was published honours the bound
        assert engine.weight_version - d.trajectory.weight_version <= 1
    if policy == "drop":
        assert metrics.GROUPS_SKIPPED.labels("stale")._value.get() > stale_before
        # The dropped group leaves the trainer's one batch short: the run rolls out another
        # step to complete it, rather than ending with the trainer waiting forever.
        assert orch.step == 2 and len(got) >= 4
    else:
        assert metrics.STALE_REGENERATED._value.get() > regen_before
        assert len(got) == 4


async def test_validation_on_the_fixed_subset(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2], weight_version=0)
    cfg = OrchestratorConfig()
    greedy = Rollout(
        cfg.rollout, engine, SearchTool(FakeRetriever(), cfg.search), tokenizer, greedy=True
    )
    orch = build(
        tokenizer,
        bus,
        engine,
        validation=(greedy, PROMPTS[:3]),
        mode="async",
        max_staleness=5,
        eval_every_steps=1,
        data={"val_path": "unused.jsonl"},
    )
    await orch.run()
    assert orch.last_eval["step"] == 2  # validated before steps 0 and 1, and after the last
    assert orch.last_eval["per_source"]["nq"]["n"] == 3
    assert orch.last_eval["per_source"]["nq"]["em"] == 1.0
    assert metrics.EVAL_SCORE.labels("nq", "em")._value.get() == 1.0
    greedy_calls = [c for c in engine.calls if c["temperature"] == 0.0]
    assert len(greedy_calls) == 3 * 3 * 2  # 3 evaluations x 3 prompts x 2 turns


def test_eval_every_steps_needs_val_path() -> None:
    with pytest.raises(ValueError, match=r"data\.val_path"):
        OrchestratorConfig.model_validate({"eval_every_steps": 2})


class RejectingEngine(ScriptedEngine):
    """Rejects (4xx) every request of one prompt: its group fails and is dropped."""

    bad_prefix: tuple[int, ...] = ()

    async def generate(self, input_ids, **kw):  # type: ignore[no-untyped-def]
        from engine_client.client import InferenceBadRequest

        if tuple(input_ids[: len(self.bad_prefix)]) == self.bad_prefix:
            raise InferenceBadRequest("/generate: HTTP 400: prompt too long")
        return await super().generate(input_ids, **kw)


async def test_sync_mode_dropped_group_does_not_deadlock(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    from orchestrator.prompt import prompt_token_ids

    engine = RejectingEngine(tokenizer, [TURN1, TURN2])
    orch = build(tokenizer, bus, engine)  # sync, 2 prompts per step, the version never moves
    bad = orch.sampler.batch(0)[0]  # a prompt of step 0 whose group fails
    engine.bad_prefix = tuple(prompt_token_ids(tokenizer, bad.messages))
    before = metrics.GROUPS_SKIPPED.labels("error")._value.get()
    # Step 0 publishes 1 group, less than one trainer batch, so no update is owed yet: step 1
    # runs at the same version instead of waiting forever for one the trainer cannot make.
    await asyncio.wait_for(orch.run(), 10)
    assert metrics.GROUPS_SKIPPED.labels("error")._value.get() == before + 1
    assert await orch.markers.published_count() == 3


class RestartingEngine(ScriptedEngine):
    """Serves version 6, then restarts mid-step (back at its base version 0) for `restarted`
    generate calls, then is re-synced to 6 by the trainer."""

    restarted: int = 0

    async def generate(self, input_ids, **kw):  # type: ignore[no-untyped-def]
        if self.restarted > 0:
            self.restarted -= 1
            self.weight_version = 0
            r = await super().generate(input_ids, **kw)
            if self.restarted == 0:
                self.weight_version = 6  # the trainer re-pushed its current weights
            return r
        return await super().generate(input_ids, **kw)


async def test_sync_mode_regenerates_what_a_restarted_engine_generated(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    """Samples generated by the base weights after an engine restart used to pass as on-policy
    in sync mode: every published turn must come from the step's version (or newer)."""
    engine = RestartingEngine(tokenizer, [TURN1, TURN2], weight_version=6)
    engine.restarted = 3
    orch = build(tokenizer, bus, engine, max_steps=1)
    regen_before = metrics.STALE_REGENERATED._value.get()
    await asyncio.wait_for(orch.run(), 10)
    got = await drain(bus)
    assert len(got) == 4
    for d in got:
        t = d.trajectory
        assert t.weight_version == 6 and all(turn.weight_version == 6 for turn in t.turns)
    assert metrics.STALE_REGENERATED._value.get() > regen_before


async def test_a_new_run_refuses_an_existing_run_id(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    """A finished run's markers made a new run with the same run.id publish nothing (every
    group "already published") while its trainer waited forever; a run with other data or
    batch sizes mixed into the old one's markers. Both are refused; a crash restart resumes."""
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2])
    await build(tokenizer, bus, engine, mode="async", max_steps=1).run()
    # The same run, restarted with one more step (a crash restart or a longer run): resumes.
    resumed = build(tokenizer, bus, engine, mode="async", max_steps=2)
    await resumed.run()
    assert resumed.step == 2
    # Started again with nothing left to roll out: refused, naming the run and the way out.
    with pytest.raises(RunIdInUse, match=r"run\.id 'run' .*already rolled out .* --fresh"):
        await build(tokenizer, bus, engine, mode="async", max_steps=2).run()
    # Other data or batch sizes under the same id: refused, naming what differs.
    other = build(tokenizer, bus, engine, mode="async", max_steps=3, epochs=2)
    with pytest.raises(RunIdInUse, match=r"epochs"):
        await other.run()
    # --fresh forgets the old run's markers and starts over.
    fresh = build(tokenizer, bus, engine, mode="async", max_steps=1, epochs=2)
    await fresh.run(fresh=True)
    assert fresh.step == 1


class TimedRollout:
    """Sample 0 of every group finishes at once, the others late; counts what runs at once."""

    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        self.tokenizer = tokenizer
        self.samples: set[str] = set()
        self.peak_samples = 0
        self.peak_groups = 0

    def prompt_ids(self, messages):  # type: ignore[no-untyped-def]
        return prompt_token_ids(self.tokenizer, messages)

    async def run_sample(self, s):  # type: ignore[no-untyped-def]
        self.samples.add(s.trajectory_id)
        self.peak_samples = max(self.peak_samples, len(self.samples))
        groups = {t.rsplit("/", 1)[0] for t in self.samples}
        self.peak_groups = max(self.peak_groups, len(groups))
        await asyncio.sleep(0.02 if s.sample_index == 0 else 0.6)
        self.samples.remove(s.trajectory_id)
        s.status = Status.ANSWERED
        return s


async def test_the_cap_counts_samples_not_groups(tokenizer, bus) -> None:  # type: ignore[no-untyped-def]
    """4 places, groups of 2 with one quick sample each: once the first two groups' quick
    samples are done, a third group fits (counted in groups, it waited for a whole group)."""
    cfg = OrchestratorConfig.model_validate(
        {"mode": "async", "rollout": {"max_concurrent_samples": 4}, "partition": {"poll_s": 0.02}}
    )
    rollout = TimedRollout(tokenizer)
    orch = Orchestrator(
        cfg,
        run=RunConfig(groups_per_step=4, group_size=2, max_steps=1),
        rollout=rollout,  # type: ignore[arg-type]
        scorer=Scorer(cfg.reward),
        engine=ScriptedEngine(tokenizer, [TURN2]),
        bus=bus,
        sampler=PromptSampler(PROMPTS, 4, seed=0, epochs=1),
    )
    await asyncio.wait_for(orch.run(), 10)
    assert rollout.peak_samples == 4 and rollout.peak_groups == 3
    assert len(await drain(bus)) == 8
