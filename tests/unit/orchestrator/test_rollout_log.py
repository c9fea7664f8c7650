"""The rollout log: what is sampled, the row contents, rotation, evaluations."""

from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import pytest

from harness.inspector_run import WordTokenizer, build_run, make_group
from harness.small_disk import fill
from orchestrator.config import RolloutLogConfig
from orchestrator.rollout_log import RolloutLog, mask_runs, question_of, select
from searchr1.rundir import TRAIN, Col, RunLayout, rollout_schema
from tests.support.small_disk import small_tmpfs


def _samples(step: int = 0, groups: int = 3, size: int = 4):  # type: ignore[no-untyped-def]
    tok, rng = WordTokenizer(), random.Random(0)
    samples = [s for i in range(groups) for s in make_group(tok, rng, step, i, size, "r")]
    return tok, samples


def test_mask_runs_and_question() -> None:
    assert mask_runs(b"\x01\x01\x00\x00\x00\x01") == [(1, 0, 2), (0, 2, 5), (1, 5, 6)]
    assert mask_runs(b"") == []
    assert question_of("Say it. Question: Who is X?\n<|im_start|>assistant\n") == "Who is X?"


def test_select_logs_groups_then_failures() -> None:
    _, samples = _samples(step=0)  # sample 3 of each group is truncated, 2 invalid (even step)
    chosen = select(samples, groups=1, failures=100)
    first = samples[0].group_id
    assert [s.sample_index for s, r in chosen if r == "group"] == [0, 1, 2, 3]
    assert all(s.group_id == first for s, r in chosen if r == "group")
    extra = {(s.sample_index, r) for s, r in chosen if r != "group"}
    assert extra == {(2, "invalid"), (3, "truncated")}
    assert len(chosen) == 4 + 2 * 2
    assert len(select(samples, groups=1, failures=1)) == 5
    assert select(samples, groups=0, failures=0) == []


def test_step_file_rows_match_trajectories(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tok, samples = _samples()
    log = RolloutLog(RolloutLogConfig(run_dir=str(tmp_path), groups_per_step=1), tok)
    path = log.write_step(0, samples, {"reward_mean": 0.5})
    rows = pq.read_table(path).to_pylist()
    by_id = {s.trajectory_id: s for s in samples}
    for row in rows:
        s = by_id[row["trajectory_id"]]
        assert row["response_token_ids"] == s.response_ids
        assert row["loss_mask"] == bytes(s.loss_mask)
        assert "".join(row["token_texts"]) == s.response_text == row["response_text"]
        assert row["rollout_logprobs"] == pytest.approx(s.logprobs, abs=1e-6)
        zero_runs = [(a, b) for v, a, b in mask_runs(bytes(s.loss_mask)) if v == 0]
        spans = [(sp["start"], sp["end"]) for sp in row["spans"] if sp["kind"] == "observation"]
        assert spans == zero_runs
        searches = [t for t in row["turns"] if t["action"] == "search"]
        assert len(searches) == row["num_searches"]
        for t in searches:
            assert t["observation"].startswith("\n\n<information>")
            assert "Doc 1(Title:" in t["observation"] or t["error"]
        assert dict(row["reward_components"])["em"] == s.reward_components["em"]
        assert row["gold_answers"] == s.golds
        assert row["question"].startswith("Where was ")
        assert row["finish_reason"] == s.status.value
        assert row["tis_weights"] is None
    record = json.loads((tmp_path / "rollouts" / "steps.jsonl").read_text())
    assert record["summary"] == {"reward_mean": 0.5}
    assert [g["logged"] for g in record["groups"]] == [[0, 1, 2, 3], [2, 3], [2, 3]]
    assert [len(g["rewards"]) for g in record["groups"]] == [4, 4, 4]


def test_rows_are_the_run_directory_contract(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every column of `searchr1.rundir` in every row, written where the layout says."""
    tok, samples = _samples(groups=1)
    log = RolloutLog(RolloutLogConfig(run_dir=str(tmp_path)), tok)
    assert all(list(row) == list(Col) for row in log._rows([(s, "group") for s in samples], TRAIN))
    path = log.write_step(0, samples, {})
    assert path == RunLayout(tmp_path).step_file(0)
    assert pq.read_schema(path).remove_metadata().equals(rollout_schema())


def test_rotation_keeps_newest_within_bound(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tok, samples = _samples(groups=1)
    log = RolloutLog(RolloutLogConfig(run_dir=str(tmp_path)), tok)
    one = log.write_step(0, samples, {}).stat().st_size
    log.cfg.max_bytes = int(2.5 * one)
    for step in range(1, 6):
        log.write_step(step, samples, {})
    names = sorted(p.name for p in (tmp_path / "rollouts" / "train").iterdir())
    assert names[-1] == "step-000005.parquet"
    assert 1 <= len(names) <= 3
    assert "step-000000.parquet" not in names


async def test_failed_write_never_raises(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tok, samples = _samples(groups=1)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    log = RolloutLog(RolloutLogConfig(run_dir=str(blocker)), tok)
    await log.log_step(0, samples, {})  # logged, not raised
    assert await log.log_eval(samples, {}, label="x") is None


def test_evaluations_are_logged_whole(tmp_path) -> None:  # type: ignore[no-untyped-def]
    build_run(tmp_path, steps=2, groups=1)
    lines = (tmp_path / "rollouts" / "evals.jsonl").read_text().splitlines()
    evals = [json.loads(x) for x in lines]
    assert [e["label"] for e in evals] == ["model-warm v0", "model-trained v0"]
    for e in evals:
        rows = pq.read_table(tmp_path / "rollouts" / "eval" / f"{e['eval_id']}.parquet")
        assert rows.num_rows == 6
        assert set(rows.column("kind").to_pylist()) == {"eval"}
    assert evals[0]["eval_id"] != evals[1]["eval_id"]


async def test_a_full_disk_is_counted_logged_once_and_leaves_nothing_partial(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """Issue 32: the run directory on a real, small filesystem (tmpfs, needs root) that fills
    up. Steps are not logged meanwhile (the rollouts go on), each failure is counted, the
    spell is logged once, no partial Parquet file is left taking room, and logging resumes
    once there is room."""
    import logging

    from orchestrator.metrics import ROLLOUT_LOG_FAILURES

    with small_tmpfs(tmp_path / "disk", 2**20) as disk:
        tok, samples = _samples(groups=3)
        log = RolloutLog(RolloutLogConfig(run_dir=str(disk), groups_per_step=3), tok)
        await log.log_step(0, samples, {})
        filler = fill(disk)
        before = ROLLOUT_LOG_FAILURES._value.get()
        with caplog.at_level(logging.INFO, logger="orchestrator.rollout_log"):
            for step in (1, 2, 3):
                await log.log_step(step, samples, {})
            assert ROLLOUT_LOG_FAILURES._value.get() == before + 3
            assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
            assert not [p for p in disk.rglob("*") if p.name.endswith(".tmp")]
            filler.unlink()
            await log.log_step(4, samples, {})
            assert any("written again" in r.getMessage() for r in caplog.records)
        steps = sorted(p.name for p in RunLayout(disk).step_file(0).parent.iterdir())
        assert steps == ["step-000000.parquet", "step-000004.parquet"]
