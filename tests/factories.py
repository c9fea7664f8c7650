"""Builders of valid test messages shared by unit and integration tests."""

from __future__ import annotations

import random
from typing import Literal

from protos.trajectory import SCHEMA_VERSION, FinishReason, Trajectory


def make_trajectory(
    trajectory_id: str = "t-0",
    *,
    group_id: str = "g-0",
    reward: float = 1.0,
    response_len: int = 12,
    prompt_len: int = 6,
    seed: int = 0,
    vocab: int = 2000,
    observation: tuple[int, int] | None = (4, 8),
    rollout_logprobs: list[float] | Literal["random"] | None = "random",
    temperature: float = 0.7,
) -> Trajectory:
    """A valid trajectory with every field set; response tokens in `observation` (a half-open
    range) are retrieved text (loss mask 0). `rollout_logprobs=None`: none recorded."""
    rng = random.Random(seed)
    mask = [
        0 if observation and observation[0] <= i < observation[1] else 1
        for i in range(response_len)
    ]
    if rollout_logprobs == "random":
        rollout_logprobs = [-rng.random() if m else 0.0 for m in mask]
    traj = Trajectory(
        schema_version=SCHEMA_VERSION,
        trajectory_id=trajectory_id,
        group_id=group_id,
        sample_index=3,
        group_size=8,
        data_source="nq",
        prompt_id="nq/train/17",
        prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
        response_token_ids=[rng.randrange(vocab) for _ in range(response_len)],
        loss_mask=bytes(mask),
        rollout_logprobs=rollout_logprobs or [0.0] * response_len,
        has_rollout_logprobs=rollout_logprobs is not None,
        weight_version=7,
        max_weight_version=8,
        finish_reason=FinishReason.FINISH_REASON_ANSWERED,
        error="",
        gold_answers=["Paris", "paris, france"],
        rollout_step=41,
        temperature=temperature,
    )
    traj.reward.total = reward
    traj.reward.components["em"] = 1.0
    traj.reward.components["format"] = 0.2
    turn = traj.turns.add()
    turn.index = 0
    turn.action = "search"
    turn.query = "capital of france"
    turn.doc_ids.extend(["12", "7", "99"])
    turn.tool_latency_s = 0.0125
    turn.tool_attempts = 2
    turn.error = ""
    turn.generated_tokens = 4
    turn.observation_tokens = 4
    turn.generate_latency_s = 0.5
    turn.engine_finish_reason = "stop"
    turn.weight_version = 7
    traj.timings.created_at = 1_700_000_000.25
    traj.timings.finished_at = 1_700_000_003.5
    traj.timings.generate_s = 2.0
    traj.timings.tool_s = 0.0125
    traj.metadata["engine"] = "torch"
    return traj
