"""Sessions onto the bus: every segment a `protos.trajectory.Trajectory` (the wire format
stays at this edge). A group's rewarded sessions are published together when the group is
done; a session that cannot be trained on goes to the dead-letter stream with its reason.

A group's trajectories share its id; `group_size` is how many are published (a session with
two segments counts twice, a dead-lettered one not at all), so the trainer's group buffer
completes on exactly these. Each segment carries its session's final reward; per-turn rewards
ride on its turns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from gateway import metrics
from gateway.bridge import Segment
from gateway.sessions import Session
from protos.trajectory import (
    SCHEMA_VERSION,
    FinishReason,
    Reward,
    Timings,
    ToolCall,
    Trajectory,
    Turn,
    validate,
)
from searchr1.bus import DEAD_LETTERS, TrajectoryBus, fields_of

log = logging.getLogger(__name__)

_FINISH = {
    "stop": FinishReason.FINISH_REASON_ANSWERED,
    "length": FinishReason.FINISH_REASON_TRUNCATED,
    "abort": FinishReason.FINISH_REASON_ABORTED,
}


def to_trajectory(s: Session, seg: Segment, sample_index: int, group_size: int) -> Trajectory:
    versions = seg.weight_versions or [0]
    last = seg.turns[-1].finish_reason if seg.turns else ""
    turns = seg.turns
    traj = Trajectory(
        schema_version=SCHEMA_VERSION,
        trajectory_id=f"{s.id}/{seg.index}",
        group_id=s.group.id,
        sample_index=sample_index,
        group_size=group_size,
        data_source=s.data_source or "gateway",
        prompt_id=s.row_id,
        prompt_token_ids=seg.prompt_ids,
        response_token_ids=seg.response_ids,
        loss_mask=bytes(seg.loss_mask),
        rollout_logprobs=seg.logprobs,
        has_rollout_logprobs=seg.has_logprobs,
        reward=Reward(total=s.reward or 0.0, components=s.components),
        weight_version=min(versions),
        max_weight_version=max(versions),
        turns=[
            Turn(
                index=t.index,
                action="tool" if t.tool_calls else "answer",
                error=t.error,
                generated_tokens=t.generated_tokens,
                # The template's tokens after this turn (before the next one), as the
                # orchestrator counts its observations.
                observation_tokens=turns[i + 1].bridge_tokens if i + 1 < len(turns) else 0,
                generate_latency_s=t.latency_s,
                engine_finish_reason=t.finish_reason,
                weight_version=t.weight_version,
                cached_tokens=t.cached_tokens,
                reward=t.reward,
                tool_calls=[ToolCall(name=n, arguments_json=a) for n, a in t.tool_calls],
            )
            for i, t in enumerate(turns)
        ],
        finish_reason=_FINISH.get(last, FinishReason.FINISH_REASON_UNSPECIFIED),
        timings=Timings(
            created_at=seg.created_at,
            finished_at=seg.finished_at or time.time(),
            generate_s=seg.generate_s,
        ),
        metadata={
            "session_id": s.id,
            "segment": str(seg.index),
            "segments": str(len(s.segments)),
            "segment_reason": seg.reason,
        },
        temperature=seg.temperature,
    )
    return validate(traj)


def group_trajectories(sessions: Sequence[Session]) -> list[Trajectory]:
    """Every segment with a model turn of `sessions` (in join order), as one group."""
    pairs = [(s, seg) for s in sessions for seg in s.segments if seg.turns]
    return [to_trajectory(s, seg, i, len(pairs)) for i, (s, seg) in enumerate(pairs)]


class Publisher:
    """Publishes groups and dead-letters sessions in background tasks (a full backlog makes
    `publish` wait; a request must not); `drain` waits for them. The trajectories are built
    at once, from the sessions as they are now."""

    def __init__(self, bus: TrajectoryBus, timeout_s: float = 600.0) -> None:
        self.bus = bus
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def publish(self, group_id: str, sessions: Sequence[Session]) -> None:
        """A done group's trajectories to the bus; a group with none (every session
        dead-lettered, or no model turn) is counted as dead-lettered."""
        trajectories = group_trajectories(sessions)
        if trajectories:
            self._spawn(self._publish(group_id, trajectories))
        else:
            metrics.GROUPS.labels("dead_lettered").inc()
            log.warning("group dead-lettered: nothing to train on", extra={"group_id": group_id})

    def dead_letter(self, s: Session, reason: str, error: str) -> None:
        metrics.DEAD_SESSIONS.labels(reason).inc()
        n = len(s.segments)
        rows = [to_trajectory(s, seg, seg.index, n) for seg in s.segments if seg.turns]
        context = {"session_id": s.id, "group_id": s.group.id, "reason": reason}
        log.warning("session dead-lettered", extra={**context, "error": error[:500]})
        if rows:
            self._spawn(self._dead_letter(rows, reason, error, context))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    async def _publish(self, group_id: str, trajectories: list[Trajectory]) -> None:
        try:
            await asyncio.wait_for(self.bus.publish(trajectories), self.timeout_s)
        except Exception as e:  # the bus's own retries are spent, or the backlog stayed full
            metrics.BUS_FAILURES.labels("publish").inc()
            log.error(
                "group lost: the bus refused it",
                extra={"group_id": group_id, "trajectories": len(trajectories), "error": repr(e)},
            )
            return
        metrics.PUBLISHED.inc(len(trajectories))
        metrics.GROUPS.labels("published").inc()
        log.info("group published", extra={"group_id": group_id, "trajectories": len(trajectories)})

    async def _dead_letter(
        self, rows: list[Trajectory], reason: str, error: str, context: dict[str, str]
    ) -> None:
        """The trajectories to the bus's dead-letter stream, as the bus writes its own (reason,
        error; never published, so no source entry): `searchr1 bus dead-letters` lists them."""
        bus = self.bus

        async def append() -> None:
            async with bus.redis.pipeline(transaction=True) as pipe:
                for traj in rows:
                    record = {
                        **fields_of(traj),
                        b"reason": reason.encode(),
                        b"error": error.encode(),
                        b"source_id": b"",
                        b"deliveries": b"0",
                        b"metadata": json.dumps(dict(traj.metadata)).encode(),
                    }
                    pipe.xadd(bus.dead_stream, record)  # type: ignore[arg-type]
                await pipe.execute()

        try:
            await asyncio.wait_for(bus.retry.call("dead_letter", append), self.timeout_s)
        except Exception as e:
            metrics.BUS_FAILURES.labels("dead_letter").inc()
            log.error(
                "dead letters lost: the bus refused them", extra={**context, "error": repr(e)}
            )
            return
        DEAD_LETTERS.labels(reason).inc(len(rows))
