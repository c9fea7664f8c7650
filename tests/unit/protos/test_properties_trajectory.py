"""Hypothesis over the trajectory wire format and the bus's decoding of hostile entries: any
bytes are a Trajectory the trainer may see, or a SchemaError (dead-lettered with its reason)
-- never another exception, which would crash the consumer on the same entry at every
delivery."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from protos.trajectory import SCHEMA_VERSION, SchemaError, decode, encode, validate
from searchr1.bus import TrajectoryBus
from tests.factories import make_trajectory


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=512))
def test_any_bytes_decode_or_raise_a_schema_error(data: bytes) -> None:
    try:
        traj = decode(data)
    except SchemaError:
        return
    validate(traj)  # what decode returns has passed validation


@settings(max_examples=300, deadline=None)
@given(
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8)
)
def test_a_corrupted_valid_message_is_decoded_or_refused(flips: list[tuple[int, int]]) -> None:
    data = bytearray(encode(make_trajectory()))
    for at, byte in flips:
        data[at % len(data)] = byte
    try:
        traj = decode(bytes(data))
    except SchemaError:
        return
    n = len(traj.response_token_ids)
    assert len(traj.loss_mask) == n and set(traj.loss_mask) <= {0, 1}
    assert math.isfinite(traj.reward.total)


@settings(max_examples=300, deadline=None)
@given(
    reward=st.floats(allow_nan=True, allow_infinity=True),
    temperature=st.floats(allow_nan=True, allow_infinity=True),
    mask=st.lists(st.integers(0, 3), max_size=16),
)
def test_validate_refuses_what_the_trainer_cannot_use(
    reward: float, temperature: float, mask: list[int]
) -> None:
    traj = make_trajectory(response_len=12)
    traj.reward.total = reward
    traj.temperature = temperature
    traj.loss_mask = bytes(mask)
    usable = (
        math.isfinite(reward)
        and math.isfinite(temperature)
        and temperature >= 0
        and len(mask) == 12
        and set(mask) <= {0, 1}
    )
    try:
        validate(traj)
    except SchemaError:
        assert not usable
    else:
        assert usable


fields = st.dictionaries(
    st.sampled_from([b"data", b"v", b"tid", b"x"]) | st.binary(max_size=4),
    st.binary(max_size=64) | st.just(str(SCHEMA_VERSION).encode()),
    max_size=4,
)


@settings(max_examples=500, deadline=None)
@given(entry=st.none() | fields)
def test_the_bus_turns_any_entry_into_a_trajectory_or_a_reason(
    entry: dict[bytes, bytes] | None,
) -> None:
    traj, reason, error = TrajectoryBus._decode_entry(entry)
    if traj is None:
        assert reason in {"missing_data", "bad_version", "unknown_version", "undecodable"}
        assert error
    else:
        assert (reason, error) == ("", "")
