"""Sample -> `protos.trajectory.Trajectory`: the wire format stays at this edge."""

from __future__ import annotations

from orchestrator.sample import Sample, Status
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

_FINISH = {
    Status.ANSWERED: FinishReason.FINISH_REASON_ANSWERED,
    Status.MAX_TURNS: FinishReason.FINISH_REASON_MAX_TURNS,
    Status.RESPONSE_BUDGET: FinishReason.FINISH_REASON_RESPONSE_BUDGET,
    Status.CONTEXT_LIMIT: FinishReason.FINISH_REASON_CONTEXT_LIMIT,
    Status.TRUNCATED: FinishReason.FINISH_REASON_TRUNCATED,
    Status.ABORTED: FinishReason.FINISH_REASON_ABORTED,
    Status.ERROR: FinishReason.FINISH_REASON_ERROR,
}


def to_trajectory(s: Sample) -> Trajectory:
    versions = s.weight_versions or [0]
    traj = Trajectory(
        schema_version=SCHEMA_VERSION,
        trajectory_id=s.trajectory_id,
        group_id=s.group_id,
        sample_index=s.sample_index,
        group_size=s.group_size,
        data_source=s.prompt.data_source,
        prompt_id=s.prompt.prompt_id,
        prompt_token_ids=s.prompt_ids,
        response_token_ids=s.response_ids,
        loss_mask=bytes(s.loss_mask),  # the wire format: one 0/1 byte per token
        rollout_logprobs=s.logprobs,
        has_rollout_logprobs=s.has_logprobs,
        reward=Reward(total=s.reward, components=s.reward_components),
        weight_version=min(versions),
        max_weight_version=max(versions),
        turns=[
            Turn(
                index=t.index,
                action=t.action,
                query=t.query,
                doc_ids=t.doc_ids,
                tool_latency_s=t.tool_latency_s,
                tool_attempts=t.tool_attempts,
                error=t.error,
                generated_tokens=t.generated_tokens,
                observation_tokens=t.observation_tokens,
                generate_latency_s=t.generate_latency_s,
                engine_finish_reason=t.engine_finish_reason,
                weight_version=t.weight_version,
                cached_tokens=t.cached_tokens,
                reward=t.reward,
                tool_calls=[
                    ToolCall(
                        name=c.name,
                        arguments_json=c.arguments_json,
                        result=c.result,
                        error=c.error,
                        latency_s=c.latency_s,
                        attempts=c.attempts,
                    )
                    for c in t.tool_calls
                ],
            )
            for t in s.turns
        ],
        finish_reason=_FINISH.get(s.status, FinishReason.FINISH_REASON_UNSPECIFIED)
        if s.status
        else FinishReason.FINISH_REASON_UNSPECIFIED,
        error=s.error,
        infrastructure_failure=s.infrastructure_failure,
        timings=Timings(
            created_at=s.created_at,
            finished_at=s.finished_at,
            generate_s=s.generate_s,
            tool_s=s.tool_s,
            reward_s=s.reward_s,
        ),
        gold_answers=s.golds,
        rollout_step=s.rollout_step,
        metadata={str(k): str(v) for k, v in {**s.prompt.metadata, **s.metadata}.items()},
        temperature=s.temperature,
    )
    return validate(traj)
