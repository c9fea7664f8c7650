"""Helpers around the `Trajectory` message: schema version, invariants, (de)serialisation."""

from __future__ import annotations

import math

from protos.trajectory_pb2 import FinishReason, Reward, Timings, ToolCall, Trajectory, Turn

__all__ = [
    "SCHEMA_VERSION",
    "FinishReason",
    "Reward",
    "SchemaError",
    "Timings",
    "ToolCall",
    "Trajectory",
    "Turn",
    "decode",
    "encode",
    "validate",
]

# Bump when the meaning of an existing field changes; consumers reject unknown versions.
SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})


class SchemaError(ValueError):
    """A trajectory that violates the contract (wrong version, misaligned per-token arrays...)."""


def validate(traj: Trajectory) -> Trajectory:
    """Check the invariants the trainer relies on; raise SchemaError naming the problem."""
    if traj.schema_version not in SUPPORTED_VERSIONS:
        raise SchemaError(
            f"unsupported schema_version {traj.schema_version} "
            f"(supported: {sorted(SUPPORTED_VERSIONS)})"
        )
    if not traj.trajectory_id:
        raise SchemaError("trajectory_id is empty")
    n = len(traj.response_token_ids)
    if len(traj.loss_mask) != n:
        raise SchemaError(f"loss_mask has {len(traj.loss_mask)} entries for {n} response tokens")
    if len(traj.rollout_logprobs) != n:
        raise SchemaError(
            f"rollout_logprobs has {len(traj.rollout_logprobs)} entries for {n} response tokens"
        )
    if traj.loss_mask.translate(None, b"\x00\x01"):  # C-speed "every byte is 0 or 1"
        raise SchemaError("loss_mask entries must be 0 or 1")
    if not math.isfinite(traj.reward.total):
        raise SchemaError(f"reward.total is not finite: {traj.reward.total}")
    if not (math.isfinite(traj.temperature) and traj.temperature >= 0):
        # The trainer divides logits by it.
        raise SchemaError(f"temperature must be finite and >= 0 (got {traj.temperature})")
    return traj


def encode(traj: Trajectory) -> bytes:
    """Serialise after validating, so nothing malformed ever reaches the bus."""
    return validate(traj).SerializeToString()


def decode(data: bytes) -> Trajectory:
    """Parse and validate; raise SchemaError for anything the trainer must not see."""
    traj = Trajectory()
    try:
        traj.ParseFromString(data)
    except Exception as e:  # protobuf raises DecodeError, a plain Exception subclass
        raise SchemaError(f"not a Trajectory message: {e}") from e
    return validate(traj)
