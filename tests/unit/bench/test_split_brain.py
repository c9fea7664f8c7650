"""harness/chaos_ledger.split_brain_steps: steps logged by a trainer that did not hold the lease."""

from __future__ import annotations

from harness.chaos_ledger import split_brain_steps

A, B = "h:1", "h:2"
# The lease: A's until 10.2, free at 10.4, B's from 10.6.
HOLDERS = [(9.0, A), (10.0, A), (10.2, A), (10.4, None), (10.6, B), (11.0, B), (12.0, B)]


def rec(step: int, who: str, when: float) -> dict[str, object]:
    return {"step": step, "trainer": who, "time": when}


def test_steps_of_the_holder_and_around_a_takeover_are_not_split_brain() -> None:
    records = [rec(1, A, 9.5), rec(2, A, 10.3), rec(3, B, 10.8), rec(4, B, 11.5)]
    assert split_brain_steps(records, HOLDERS) == []


def test_a_step_by_the_old_holder_well_after_the_takeover_is() -> None:
    records = [rec(3, B, 10.8), rec(3, A, 11.5), rec(4, B, 11.7)]
    assert split_brain_steps(records, HOLDERS) == [3]


def test_unobserved_times_and_records_without_identity_are_not_judged() -> None:
    records = [rec(1, B, 8.0), rec(9, A, 13.0), {"step": 5, "time": 11.5}]
    assert split_brain_steps(records, HOLDERS) == []
