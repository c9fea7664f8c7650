"""harness/chaos_ledger: the published set (the tap's) against what the trainer's checkpoints
say it trained (issue 46's independent ledger), on hand-made data."""

from __future__ import annotations

import json
from pathlib import Path

from harness.chaos_ledger import CheckpointWatch, settle, split_brain_steps
from searchr1.bus import Receipt
from trainer.checkpoint import LATEST, TrainerState


def ckpt(step: int, tids: str) -> dict[str, object]:
    return {"step": step, "trajectory_ids": list(tids)}


def lines(*steps: tuple[int, str]) -> list[dict[str, object]]:
    return [{"step": s, "trajectory_ids": list(t)} for s, t in steps]


def test_a_clean_run_settles_to_nothing_lost_or_duplicated() -> None:
    checkpoints = [ckpt(2, "abcd"), ckpt(4, "efgh")]
    logged = lines((1, "ab"), (2, "cd"), (3, "ef"), (4, "gh"))
    result = settle(set("abcdefgh"), checkpoints, logged=logged, dead={})
    assert (result.published, result.trained, result.steps) == (8, 8, 4)
    assert result.lost == result.duplicated == result.unpublished == result.unlogged == []


def test_lost_duplicated_and_unpublished_are_told_apart() -> None:
    # e was published and is in no checkpoint; c is in two (trained again after a resume
    # that did not go back far enough); z was trained but never added to the stream; d was
    # dead-lettered (lost, with its reason).
    checkpoints = [ckpt(2, "abc"), ckpt(4, "cfz")]
    result = settle(set("abcdef"), checkpoints, logged=[], dead={"d": "max_deliveries"})
    assert result.lost == ["d", "e"]
    assert result.dead == {"d": "max_deliveries"}
    assert result.duplicated == ["c"]
    assert result.unpublished == ["z"]
    assert result.unlogged == sorted("abcfz")  # no step line names them


def test_a_resume_from_an_older_checkpoint_replaces_the_later_ones() -> None:
    # The checkpoint of step 4 was made, then the trainer resumed from step 2 (the one of
    # step 4 never became `latest` elsewhere: here a fenced trainer's, say) and made 3-4 again
    # from other entries: only the lineage that made the final model counts.
    checkpoints = [ckpt(2, "ab"), ckpt(4, "cd"), ckpt(4, "ce"), ckpt(6, "fg")]
    result = settle(set("abcefg"), checkpoints, logged=[], dead={})
    assert (result.lost, result.duplicated, result.rewinds, result.steps) == ([], [], 1, 6)
    assert result.unpublished == []  # d was replaced: not trained, and never published


def test_a_trainer_without_the_lease_is_split_brain() -> None:
    holders = [(1.0, "h:1"), (2.0, "h:2"), (3.0, "h:2"), (4.0, "h:2")]
    records = [
        {"step": 1, "trainer": "h:1", "time": 1.5},  # just before the takeover: not judged
        {"step": 2, "trainer": "h:2", "time": 2.5},
        {"step": 2, "trainer": "h:1", "time": 3.5},  # the fenced one logged a step anyway
    ]
    assert split_brain_steps(records, holders) == [2]


def write_checkpoint(root: Path, step: int, tids: str) -> None:
    state = TrainerState(step=step, receipts=[Receipt(f"{i}-0", t) for i, t in enumerate(tids)])
    directory = root / f"step_{step:08d}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trainer.json").write_text(json.dumps(state.to_json()))
    (root / LATEST).write_text(directory.name)


def test_the_watch_reads_each_checkpoint_latest_names_once(tmp_path: Path) -> None:
    watch = CheckpointWatch(tmp_path)
    watch.poll()  # no checkpoint yet
    write_checkpoint(tmp_path, 2, "ab")
    watch.poll()
    watch.poll()
    write_checkpoint(tmp_path, 4, "cd")
    watch.poll()
    write_checkpoint(tmp_path, 4, "ce")  # the same step made again after a resume
    watch.poll()
    assert watch.records == [ckpt(2, "ab"), ckpt(4, "cd"), ckpt(4, "ce")]
    result = settle(set("abce"), watch.records, logged=[], dead={})
    assert (result.lost, result.duplicated, result.trained) == ([], [], 4)
