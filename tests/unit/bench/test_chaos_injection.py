"""bench/chaos.py injects what it is asked or says why not, never reports a negative recovery,
and exits non-zero only saying why (issue 46: 24 of 30 faults injected before the 126 steps ran
out, exit 1 without a word, a recovery of -40 s for the fault at the last step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import (
    ChaosConfig,
    Fault,
    RunResult,
    default_steps,
    failures,
    not_injected_reason,
    report,
    settle_recovery,
)
from harness.chaos_ledger import LedgerResult

FREEZE = (10.0, 90.0)


def result(faults: list[Fault], *, steps: int = 10, **kw: object) -> RunResult:
    ledger = LedgerResult(published=8, trained=8, steps=steps)
    return RunResult(ledger, faults, stalled_s_max=4.0, em_after=0.5, restarts={}, finished=True,
                     **kw)  # type: ignore[arg-type]  # fmt: skip


def test_the_default_steps_leave_room_for_faults_the_run_goes_on_through() -> None:
    """A slow or lossy link, a full checkpoint disk: steps go on while it lasts (10-90 s), so
    such a fault spends more steps than a kill; 4 per fault + 6 ran out at 24 of 30."""
    assert default_steps(["kill:trainer", "kill:redis", "refuse_push"], FREEZE) == 18  # as before
    kill = default_steps(["kill:trainer"], FREEZE)
    for kind in ("slow_link:inference", "lossy_link:retriever", "disk_full:checkpoint"):
        assert default_steps([kind], FREEZE) >= kill + 50 / 5  # a mean fault's steps at ~5 s
    assert default_steps(["slow_link:inference"], (5.0, 10.0)) < default_steps(
        ["slow_link:inference"], FREEZE
    )
    cfg = ChaosConfig(out_dir=Path("unused"), faults=2, kinds=("slow_link:inference",))
    assert cfg.steps == default_steps(["slow_link:inference"] * 2, FREEZE)
    assert ChaosConfig(out_dir=Path("unused"), faults=2, max_steps=7).steps == 7


def test_a_fault_the_run_finished_during_recovers_in_zero_seconds_not_less() -> None:
    """A 90 s link fault injected near the end: the run finished 40 s before the fault did,
    and the bench reported recover_s=-40."""
    during = Fault("slow_link:inference", injected_at=0.0, ended_at=100.0, recovered_at=60.0)
    assert settle_recovery(during) is True
    assert during.recover_s == 0.0
    after = Fault("kill:trainer", injected_at=0.0, ended_at=0.0, recovered_at=12.5)
    assert settle_recovery(after) is False
    assert after.recover_s == 12.5
    lost = Fault("kill:trainer", injected_at=0.0, ended_at=0.0)
    assert settle_recovery(lost) is False and lost.recover_s is None


def test_faults_not_injected_are_named_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    reason = not_injected_reason(
        done=False, error="", steps_done=125, steps=126, injected=24, faults=30
    )
    assert "126 steps ran out" in reason and "--steps" in reason
    cfg = ChaosConfig(out_dir=Path("unused"), faults=3, max_steps=10)
    chaos = result([Fault("kill:trainer", 1.0, 1.0, 3.0)], not_injected=["kill:redis",
                   "refuse_push"], not_injected_reason=reason)  # fmt: skip
    _, ok = report(cfg, chaos, None)
    assert not ok
    printed = capsys.readouterr().out
    assert "not injected: kill:redis, refuse_push" in printed and reason in printed
    assert any("injected 1 of 3 faults" in why for why in failures(cfg, chaos))


def test_the_reason_a_run_stopped_injecting() -> None:
    assert "stack stopped" in not_injected_reason(
        done=True, error="ChildFailed('trainer ...')", steps_done=5, steps=126, injected=1, faults=2
    )
    assert "finished" in not_injected_reason(
        done=True, error="", steps_done=126, steps=126, injected=29, faults=30
    )


def test_a_failed_run_says_why_and_a_good_one_has_nothing_to_say() -> None:
    cfg = ChaosConfig(out_dir=Path("unused"), faults=1, max_steps=10)
    good = result([Fault("kill:trainer", 1.0, 1.0, 3.0)])
    assert failures(cfg, good) == [] and report(cfg, good, None)[1]
    bad = result([Fault("freeze:redis", 1.0, 30.0)], steps=5, error="ChildFailed('trainer')")
    bad.ledger.lost.append("g/0")
    bad.split_brain = 1
    why = " | ".join(failures(cfg, bad))
    for words in ("not recovered: freeze:redis", "lost 1", "5 of 10 steps", "split_brain 1",
                  "stack stopped: ChildFailed('trainer')"):  # fmt: skip
        assert words in why, why


def test_the_independent_ledger_fails_a_run_it_cannot_vouch_for() -> None:
    """Issue 46: trained ids the tap never saw published, or stream entries it could not name,
    fail the run: the ledger is short, whatever lost says."""
    cfg = ChaosConfig(out_dir=Path("unused"), faults=1, max_steps=10)
    bad = result([Fault("kill:trainer", 1.0, 1.0, 3.0)])
    bad.ledger.unpublished.append("g/1")
    bad.ledger.unseen = 2
    why = " | ".join(failures(cfg, bad))
    assert "1 trajectories trained that the tap never saw published" in why, why
    assert "could not identify 2 stream entries" in why, why
    line, ok = report(cfg, bad, None)
    assert not ok and "unseen=2" in line.split()


def test_concurrent_faults_need_fewer_steps_and_the_line_says_how_many_overlapped() -> None:
    kinds = ["kill:trainer", "freeze:redis", "pause:inference", "slow_link:retriever"] * 5
    one = default_steps(kinds, FREEZE)
    assert default_steps(kinds, FREEZE, 1) == one
    assert default_steps(kinds, FREEZE, 3) == 6 + -(-2 * (one - 6) // 4)  # half the fault steps
    cfg = ChaosConfig(out_dir=Path("unused"), faults=20, kinds=tuple(kinds[:4]), concurrent=3)
    assert cfg.steps == default_steps(kinds, FREEZE, 3)
    line, _ = report(cfg, result([], concurrent_max=3), None)
    assert "concurrent_max=3" in line.split()
