"""The rollout loop: steps of prompt groups -> scored trajectories on the bus.

Modes (by the engine's weight version, which starts at `base` and is bumped by every update):
- sync: a step starts once the engine serves version `base + published // G` (G =
  `run.groups_per_step`, shared with the trainer): the trainer has consumed every full
  batch published so far and pushed new weights, so samples are on-policy;
- async: the same bound minus `max_staleness`; at publish time a group whose oldest turn is
  more than `max_staleness` versions behind the version it will be trained at (its batch's,
  `base + published // G`, or the engine's if newer) is dropped or regenerated (by config).
  Steps overlap: the next starts once every group of this one is claimed, while its slowest
  run (orchestrator.step_window); its bound counts those unfinished groups as published.
Counting published groups rather than steps means a dropped group (stale, or a sample that
failed) never deadlocks the pair: the trainer's next batch is filled from the next step.

Restarts: the next step, the base version and the ids of published groups live in Redis. A
step's prompts and trajectory ids are pure functions of (run_id, step, prompt, sample), so a
restarted orchestrator re-runs an unfinished step, skips the groups it already published, and
any group republished after a crash between publish and marker carries the same trajectory ids,
which the bus deduplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from orchestrator import metrics
from orchestrator.config import Mode, OrchestratorConfig, StalePolicy
from orchestrator.data import PromptSampler
from orchestrator.evaluate import evaluate
from orchestrator.group_filter import load_group_filter
from orchestrator.markers import RunMarkers, check_same_run, run_finished, run_record
from orchestrator.partition import StepClaims
from orchestrator.rollout import Rollout
from orchestrator.rollout_log import RolloutLog
from orchestrator.sample import Prompt, Sample, Status, new_group
from orchestrator.scoring import Scorer
from orchestrator.step_window import StepWindow
from orchestrator.trajectory import to_trajectory
from searchr1.redis_retry import RedisRetry
from searchr1.sections import BusConfig, RunConfig

log = logging.getLogger(__name__)


class Engine(Protocol):
    async def get_model_info(self) -> dict[str, Any]: ...


class Bus(Protocol):
    redis: Any
    config: BusConfig

    async def publish(self, trajectories: list[Any]) -> list[str]: ...
    async def end(self, reason: str) -> None: ...
    async def reopen(self) -> None: ...


def step_groups(run_id: str, step: int, batch: list[Prompt]) -> dict[str, Prompt]:
    """group id -> prompt for one step. A step straddling two epochs may draw a prompt twice:
    the repeat is a group of its own (`<prompt_id>#2`); keyed by prompt id alone it vanished, the
    step published a group short, and the trainer waited forever for its last batch (found by
    bench/chaos.py)."""
    groups: dict[str, Prompt] = {}
    for prompt in batch:
        p, n = prompt, 1
        while f"{run_id}/{step}/{p.prompt_id}" in groups:
            n += 1
            p = replace(prompt, prompt_id=f"{prompt.prompt_id}#{n}")
        groups[f"{run_id}/{step}/{p.prompt_id}"] = p
    return groups


# How often a step with dynamic sampling checks whether its slots are all taken.
SLOT_POLL_S = 0.2

# What became of a step's group: on the bus, or why not.
GROUP_OUTCOMES = ("published", "already_published", "filtered", "surplus", "stale", "error")


@dataclass
class StepState:
    """What a running step's groups share (in async mode several steps run at once)."""

    step: int
    version: int  # the weight version the step waited for
    slots: int  # dynamic sampling: the groups it may publish
    full: asyncio.Event = field(default_factory=asyncio.Event)  # its slots are all taken


@dataclass
class GroupResult:
    group_id: str
    outcome: str  # one of GROUP_OUTCOMES
    samples: list[Sample]  # empty when it never ran (already published, or the step was full)


class WeightsNotPushed(RuntimeError):
    """The engine did not reach the version a step needs within `weight_wait_s`."""


class Orchestrator:
    def __init__(
        self,
        cfg: OrchestratorConfig,
        *,
        run: RunConfig,
        rollout: Rollout,
        scorer: Scorer,
        engine: Engine,
        bus: Bus,
        sampler: PromptSampler,
        validation: tuple[Rollout, list[Prompt]] | None = None,
        rollout_log: RolloutLog | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_cfg = run
        self.rollout = rollout
        self.scorer = scorer
        self.engine = engine
        self.bus = bus
        self.sampler = sampler
        self.validation = validation  # (greedy rollout, the fixed validation subset)
        self.rollout_log = rollout_log  # sampled trajectories for `searchr1 inspect`
        # Dynamic sampling: groups the filter rejects are never published; a step starts
        # `over_sampling` more groups and publishes what the trainer's batch needs (slots).
        self.group_filter = load_group_filter(cfg.rollout.group_filter)
        self._dynamic = cfg.rollout.over_sampling > 0 or self.group_filter is not None
        # Async steps overlap, but not with dynamic sampling: a step's slots complete the
        # trainer's batch, which is known only once the step before has published its groups.
        self._overlap = cfg.mode == Mode.ASYNC and not self._dynamic
        self.last_eval: dict[str, Any] = {}
        self.prefix = f"searchr1:orchestrator:{run.id}"
        # The bus's deadline: one knob for how long any Redis call waits out an outage.
        self.redis_retry = RedisRetry("orchestrator", bus.config.reconnect_timeout_s)
        self.base_version: int | None = None
        self._publishing = asyncio.Lock()
        self.step = 0  # the lowest step not finished: where a restart resumes
        self.current_version = 0
        self.running = False
        self.last_summary: dict[str, float] = {}
        # Every process of the run claims its share of each step's groups through Redis, a whole
        # group whenever its samples fit under `max_concurrent_samples`. Samples are counted
        # one by one: a sample that finishes frees its place at once, not when its whole group
        # does (counted in groups, a process ran ~60% of its cap: groups wait on their slowest).
        self._finished_early = 0  # finished samples of groups still held
        self.markers = RunMarkers(bus.redis, self.prefix, self.redis_retry)
        self.claims = StepClaims(
            bus.redis,
            self.prefix,
            cfg.partition,
            self.redis_retry,
            max_groups=cfg.rollout.max_concurrent_samples,
            room=self._room,
        )

    # -- the run's markers in Redis (orchestrator.markers) ------------------------------------

    async def forget(self) -> None:
        """Delete this run id's markers and claims (`--fresh`): the next start is a new run."""
        await self.markers.forget()
        await self.claims.forget()
        await self.bus.reopen()
        log.warning("forgot the run's markers", extra={"run_id": self.run_cfg.id})

    async def restore(self, last_step: int | None = None) -> None:
        """Resume: the next step and the base weight version (set once, on the first start).

        Raises RunIdInUse for a run id that belongs to another run (other data or batch sizes)
        or that has nothing left to roll out (`last_step` reached: a new run reusing the id)."""
        record = run_record(self.cfg, self.run_cfg)
        base, step, stored = await self.markers.restore(await self.engine_version(), record)
        self.base_version, self.step = base, step
        check_same_run(self.run_cfg.id, record, stored, step, last_step)
        if self.step:
            log.info("resuming", extra={"step": self.step, "base_version": self.base_version})

    # -- weights ----------------------------------------------------------------------------

    async def engine_version(self) -> int:
        info = await self.engine.get_model_info()
        self.current_version = max(self.current_version, int(info["weight_version"]))
        return int(info["weight_version"])

    def batch_version(self, published: int) -> int:
        """The version the trainer trains the next published group at: that of its batch, after
        `published // groups_per_step` steps (the bus is read in publish order)."""
        assert self.base_version is not None
        return self.base_version + published // self.run_cfg.groups_per_step

    def required_version(self, published: int) -> int:
        """The version the engine must serve before more groups are generated."""
        lag = self.cfg.max_staleness if self.cfg.mode == Mode.ASYNC else 0
        return self.batch_version(published) - lag

    async def wait_for_weights(self, step: int, earlier: list[int] | None = None) -> int:
        """Wait until the engine serves the version this step needs; returns that version.
        `earlier`: steps still in flight; their unfinished groups count as published (the
        bound holds for the data as the trainer will see it, not as far as it is published).
        Bounded by `weight_wait_s`: past it no trainer is pushing (it stopped, or its own push
        deadline gave up), and waiting on in silence would hide that; the error makes the
        service exit 1 with /ready red, which the supervisor or Kubernetes reports and restarts."""
        ahead = sum([await self.claims.unfinished(k) for k in earlier or []])
        need = self.required_version(await self.markers.published_count() + ahead)
        start = time.monotonic()
        logged = False
        served: int | str = "nothing (unreachable)"
        try:
            while True:
                try:
                    served = await self.engine_version()
                    if served >= need:
                        return need
                except Exception as e:  # engine restarting: keep waiting, it is not an error yet
                    served = f"nothing ({type(e).__name__})"
                    if not logged:
                        log.warning("engine unreachable while waiting", extra={"error": repr(e)})
                        logged = True
                waited = time.monotonic() - start
                metrics.WEIGHT_WAIT.set(waited)
                if waited >= self.cfg.weight_wait_s:
                    raise WeightsNotPushed(
                        f"step {step} needs weight version {need}, the engine serves {served} "
                        f"after {waited:.0f} s (orchestrator.weight_wait_s): is the trainer "
                        "running and pushing to this engine?"
                    )
                if not logged:
                    log.info("waiting for weights", extra={"step": step, "need_version": need})
                    logged = True
                await asyncio.sleep(self.cfg.weight_poll_s)
        finally:
            metrics.WEIGHT_WAIT.set(0)

    # -- running ----------------------------------------------------------------------------

    async def run(self, *, fresh: bool = False) -> None:
        """Run steps until the trainer has every group it will train on (`run.max_steps` x
        `run.groups_per_step`) or the data is used up; `fresh` first forgets an earlier run
        with the same id.

        A step that publishes fewer groups than `groups_per_step` (filtered, stale, failed)
        leaves the trainer's batch to the next step, so a run with max_steps may roll out more
        steps than max_steps: else the trainer would wait forever for its last batch."""
        self.running = True
        if fresh:
            await self.forget()
        try:
            await self.restore(self.sampler.num_steps)
            if self.step and not await self._more_steps(self.step):
                raise run_finished(self.run_cfg.id, self.step)
            await self._run_steps()
            await self.maybe_validate(self.step, final=True)
        finally:
            self.running = False
        await self._check_fed()
        log.info("rollout finished", extra={"steps": self.step})

    async def _run_steps(self) -> None:
        """Start steps in order, up to `max_staleness + 1` at once in async mode
        (orchestrator.step_window; the weight gate allows no more), and record each finished
        step once every step before it is finished too."""
        window = StepWindow(self.cfg.max_staleness + 1 if self._overlap else 1)
        next_step = self.step
        try:
            while True:
                while len(window) and not window.has_room():
                    await self._retire(window, next_step)
                if len(window) and self._counts_published(next_step):
                    while len(window):  # whether to go on depends on what they publish
                        await self._retire(window, next_step)
                if not await self._more_steps(next_step):
                    break
                await self.maybe_validate(next_step)
                window.start(
                    next_step,
                    lambda drained, k=next_step, e=window.steps(): self.run_step(
                        k, drained=drained, earlier=e
                    ),
                )
                next_step += 1
            while len(window):
                await self._retire(window, next_step)
        finally:
            await window.cancel()

    async def _retire(self, window: StepWindow, next_step: int) -> None:
        if await window.wait():
            in_flight = window.steps()
            self.step = in_flight[0] if in_flight else next_step
            await self.markers.save_step(self.step)
            metrics.STEP.set(self.step)

    def _groups_needed(self) -> int | None:
        """Groups the trainer will consume: None when it trains as long as there is data."""
        max_steps = self.run_cfg.max_steps
        return None if max_steps is None else max_steps * self.run_cfg.groups_per_step

    def _counts_published(self, step: int) -> bool:
        """Whether `step` runs only if the trainer still lacks groups (past `max_steps`)."""
        return self._groups_needed() is not None and step >= (self.run_cfg.max_steps or 0)

    async def _more_steps(self, step: int) -> bool:
        if step >= self.sampler.num_steps:
            return False
        if not self._counts_published(step):
            return True
        return await self.markers.published_count() < (self._groups_needed() or 0)

    async def _check_fed(self) -> None:
        needed = self._groups_needed()
        if needed is None:
            return
        published = await self.markers.published_count()
        if published < needed:
            reason = (
                f"the orchestrator's data ran out after {published} of {needed} groups "
                f"(run.max_steps x run.groups_per_step), {self.step} rollout steps: raise "
                "orchestrator.epochs (or lower the group filter's rate)"
            )
            log.error(reason, extra={"published": published, "needed": needed})
            await self.bus.end(reason)  # the trainer stops waiting for groups that never come

    async def maybe_validate(self, step: int, final: bool = False) -> None:
        """Greedy validation before every `eval_every_steps`-th step (and after the last one)."""
        every = self.cfg.eval_every_steps
        if self.validation is None or every is None or (step % every and not final):
            return
        rollout, prompts = self.validation
        result = await evaluate(
            self.cfg,
            rollout,
            prompts,
            run_id=self.run_cfg.id,
            rollout_log=self.rollout_log,
            label=f"step {step}",
            step=step,
        )
        for source, scores in result["per_source"].items():
            for m in ("em", "sub_em", "f1"):
                metrics.EVAL_SCORE.labels(source, m).set(scores[m])
        self.last_eval = {"step": step, "version": self.current_version, **result}
        log.info("validation", extra={"step": step, "macro": result["macro"]})

    async def run_step(
        self, step: int, *, drained: asyncio.Event | None = None, earlier: list[int] | None = None
    ) -> dict[str, float]:
        """Roll out one step (with this run's other processes); `drained` is set once every
        group is claimed, `earlier` are the steps still in flight (see wait_for_weights)."""
        version = await self.wait_for_weights(step, earlier)
        start = time.perf_counter()
        prompts = step_groups(self.run_cfg.id, step, self.sampler.batch(step))
        state = StepState(step, version, slots=self.run_cfg.groups_per_step)
        watcher = None
        if self._dynamic:
            # Publish what completes the trainer's current batch, no more: a short step (groups
            # filtered) is completed by the next one, from the same weights in sync mode; and
            # start only that plus the over-sampling.
            g = self.run_cfg.groups_per_step
            state.slots = await self.markers.slot_limit(
                step, g - await self.markers.published_count() % g
            )
            keep = state.slots + self.cfg.rollout.over_sampling
            prompts = dict(list(prompts.items())[:keep])
            watcher = asyncio.create_task(self._watch_slots(state))
        try:
            results = await self.claims.run_step(
                step, list(prompts), lambda gid: self._run_group(state, prompts[gid]), drained
            )
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
        samples = [s for r in results for s in r.samples]
        summary = metrics.step_summary(samples, time.perf_counter() - start)
        summary["step"] = float(step)
        for outcome in GROUP_OUTCOMES:
            summary[f"groups_{outcome}"] = float(sum(r.outcome == outcome for r in results))
        self.last_summary = summary
        log.info("step done", extra=summary)
        if self.rollout_log is not None:
            outcomes = {r.group_id: r.outcome for r in results}
            await self.rollout_log.log_step(step, samples, summary, outcomes)
        return summary

    async def _watch_slots(self, state: StepState) -> None:
        """Set `state.full` once the step's slots are all taken (by any process of the run)."""
        while not state.full.is_set():
            if await self.markers.slots_taken(state.step) >= state.slots:
                state.full.set()
                return
            await asyncio.sleep(SLOT_POLL_S)

    async def _run_until_full(self, state: StepState, group: list[Sample]) -> bool:
        """Run the group's samples; False when the step's slots were all taken first: the
        group is stopped (its engine calls aborted), so the step ends with its last needed
        group rather than its slowest (slime aborts its over-sampled requests the same way)."""
        running = asyncio.create_task(self._run_samples(group))
        full = asyncio.create_task(state.full.wait())
        try:
            await asyncio.wait({running, full}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            full.cancel()
        if running.done():
            running.result()  # its own failure is the group's
            return True
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        for sample in group:
            if sample.status is None:
                sample.status, sample.error = Status.ABORTED, "stopped: the step had its groups"
        return False

    async def _run_group(self, state: StepState, prompt: Prompt) -> GroupResult:
        step = state.step
        group_id = f"{self.run_cfg.id}/{step}/{prompt.prompt_id}"
        if await self.markers.published(step, group_id):
            metrics.GROUPS_SKIPPED.labels("already_published").inc()
            log.info("group already published; skipping", extra={"group_id": group_id})
            return GroupResult(group_id, "already_published", [])
        if self._dynamic and state.full.is_set():  # the watcher's: the step is full
            metrics.GROUPS_SKIPPED.labels("surplus").inc()  # not started
            return GroupResult(group_id, "surplus", [])
        # Tokenized per group, not cached: a cache over a 170k-row dataset costs gigabytes.
        prompt_ids = self.rollout.prompt_ids(prompt.messages)
        while True:
            group = new_group(
                prompt,
                prompt_ids,
                group_size=self.run_cfg.group_size,
                rollout_step=step,
                run_id=self.run_cfg.id,
            )
            if self._dynamic:
                if not await self._run_until_full(state, group):
                    return self._discard(group_id, "surplus", group)
            else:
                await self._run_samples(group)
            if any(s.status in (Status.ERROR, Status.ABORTED) for s in group):
                log.warning(
                    "group dropped: a sample failed",
                    extra={
                        "group_id": group_id,
                        "error": next((s.error for s in group if s.error), ""),
                    },
                )
                return self._discard(group_id, "error", group)
            await self.scorer.score_group(group)
            engine_now = await self._engine_version_now()
            # One publish at a time in this process: the staleness check reads the batch the
            # group joins, which two concurrent publishes would both claim.
            async with self._publishing:
                if await self._fresh(state, group, engine_now):
                    return await self._publish(state, group_id, group)
            if self.cfg.mode == Mode.SYNC:
                # Generated by older weights than the step's: the engine restarted (back at its
                # base version). Wait for the trainer to re-sync it, then generate again.
                metrics.STALE_REGENERATED.inc()
                log.warning(
                    "group regenerated: older weights than the step's (an engine restart?)",
                    extra={"group_id": group_id, "need_version": state.version},
                )
                await self.wait_for_weights(step)
                continue
            if self.cfg.stale_policy == StalePolicy.DROP:
                return self._discard(group_id, "stale", group)
            metrics.STALE_REGENERATED.inc()

    async def _publish(self, state: StepState, group_id: str, group: list[Sample]) -> GroupResult:
        """A fresh group through the filter and the step's slots onto the bus."""
        if self.group_filter is not None and not self.group_filter(group):
            return self._discard(group_id, "filtered", group)
        if self._dynamic and not await self.markers.take_slot(state.step, group_id, state.slots):
            return self._discard(group_id, "surplus", group)  # the step filled meanwhile
        await self.bus.publish([to_trajectory(s) for s in group])
        await self.markers.mark_published(state.step, group_id)
        metrics.GROUPS_PUBLISHED.inc()
        return GroupResult(group_id, "published", group)

    @staticmethod
    def _discard(group_id: str, outcome: str, group: list[Sample]) -> GroupResult:
        """A generated group that is never trained: counted, and kept for the rollout log."""
        metrics.GROUPS_SKIPPED.labels(outcome).inc()
        metrics.DISCARDED_TOKENS.labels(outcome).inc(sum(sum(s.loss_mask) for s in group))
        return GroupResult(group_id, outcome, group)

    def _room(self, groups_held: int) -> bool:
        """One more group fits: its samples and those still running (always one group)."""
        size, cap = self.run_cfg.group_size, self.cfg.rollout.max_concurrent_samples
        return groups_held == 0 or (groups_held + 1) * size - self._finished_early <= cap

    async def _run_samples(self, group: list[Sample]) -> None:
        """The group's samples concurrently (no barrier between turns); each one that finishes
        counts as a free place until the group is done."""
        done = 0

        async def one(sample: Sample) -> None:
            nonlocal done
            await self.rollout.run_sample(sample)
            done += 1
            self._finished_early += 1

        try:
            await asyncio.gather(*(one(s) for s in group))
        finally:
            self._finished_early -= done

    async def _engine_version_now(self) -> int:
        """Async mode: the engine's version now, or the newest seen if it is down right now."""
        if self.cfg.mode == Mode.ASYNC:
            with contextlib.suppress(Exception):
                await self.engine_version()
        return self.current_version

    async def _fresh(self, state: StepState, group: list[Sample], engine_now: int) -> bool:
        oldest = min(v for s in group for v in (s.weight_versions or [0]))
        newest = max([engine_now, *(v for s in group for v in s.weight_versions)])
        if self.cfg.mode == Mode.ASYNC:
            # Overlapping steps publish out of order: a slow group of an earlier step joins a
            # later batch, trained at a version the engine may not serve yet. The bound is the
            # trainer's (AReaL's): judged against the batch the group joins.
            newest = max(newest, self.batch_version(await self.markers.published_count()))
        lag = newest - oldest
        metrics.STALENESS.observe(lag)
        if self.cfg.mode == Mode.SYNC:
            # Every turn from the step's weights (or newer, if a push landed mid-step).
            return oldest >= state.version
        return lag <= self.cfg.max_staleness
