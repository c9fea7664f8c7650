"""bench/chaos.py's summary line, with and without the fault-free run (--no-baseline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import ChaosConfig, Fault, RunResult, report
from harness.chaos_ledger import LedgerResult


def run(em: float, recovered: bool = True) -> RunResult:
    faults = [Fault("kill:trainer", 10.0, 11.0, 13.5 if recovered else None)]
    ledger = LedgerResult(published=8, trained=8, steps=10)
    return RunResult(ledger, faults, stalled_s_max=4.0, em_after=em, restarts={}, finished=True)


def values(line: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in line.split())


@pytest.mark.parametrize("with_base", [True, False])
def test_the_line_names_the_fault_free_em_only_when_it_ran(
    with_base: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = ChaosConfig(out_dir=Path("unused"), faults=1, max_steps=10)
    line, ok = report(cfg, run(0.5), run(0.75) if with_base else None)
    got = values(line)
    assert ok and got["faults"] == got["recovered"] == "1" and got["recover_p50_s"] == "2.5"
    assert got["em_after"] == "0.500"
    assert got["em_after_no_faults"] == ("0.750" if with_base else "-")
    printed = capsys.readouterr().out
    assert ("not run (--no-baseline)" in printed) is not with_base


def test_an_unrecovered_fault_fails_the_run() -> None:
    cfg = ChaosConfig(out_dir=Path("unused"), faults=1, max_steps=10)
    _, ok = report(cfg, run(0.5, recovered=False), None)
    assert not ok
