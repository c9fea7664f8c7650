"""The Trajectory contract: invariants, serialisation, generated code freshness."""

from __future__ import annotations

import subprocess
import sys

import pytest

from protos.trajectory import SchemaError, decode, encode, validate
from tests.factories import make_trajectory


def test_encode_decode_round_trip() -> None:
    traj = make_trajectory(response_len=50)
    back = decode(encode(traj))
    assert back == traj
    assert back.reward.components["em"] == 1.0
    assert list(back.loss_mask) == list(traj.loss_mask)
    assert back.temperature == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: setattr(t, "schema_version", 2), "unsupported schema_version 2"),
        (lambda t: t.ClearField("trajectory_id"), "trajectory_id is empty"),
        (lambda t: setattr(t, "loss_mask", t.loss_mask[:-1]), "loss_mask has 11 entries for 12"),
        (lambda t: t.rollout_logprobs.append(0.0), "rollout_logprobs has 13 entries for 12"),
        (lambda t: setattr(t, "loss_mask", b"\x02" + t.loss_mask[1:]), "must be 0 or 1"),
        (lambda t: setattr(t.reward, "total", float("nan")), "not finite"),
        (lambda t: setattr(t, "temperature", -0.5), "temperature must be finite and >= 0"),
        (lambda t: setattr(t, "temperature", float("inf")), "temperature must be finite"),
    ],
)
def test_invalid_trajectories_are_rejected(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    traj = make_trajectory()
    mutate(traj)
    with pytest.raises(SchemaError, match=message):
        validate(traj)
    with pytest.raises(SchemaError):
        encode(traj)  # nothing malformed reaches the bus


def test_decode_rejects_garbage() -> None:
    with pytest.raises(SchemaError, match="not a Trajectory"):
        decode(b"\xff\xff\xff")


def test_generated_code_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "protos.generate", "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
