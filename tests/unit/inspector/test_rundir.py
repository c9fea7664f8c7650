"""Reading a run directory: incremental JSON lines, refs, filters, curves, comparisons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.inspector_run import build_run
from inspector import views
from inspector.config import InspectorConfig
from inspector.rundir import JsonlTail, Ref, RunDir
from searchr1.rundir import SUMMARY_COLUMNS, TRAIN_METRICS, rollout_schema


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    path = tmp_path_factory.mktemp("run")
    build_run(path, steps=5, groups=2, group_size=4)
    return RunDir(path)


def test_the_reader_reads_the_contract() -> None:
    """The inspector's defaults are `searchr1.rundir`'s (its leaf config spells the file name)."""
    assert InspectorConfig().metrics_file == TRAIN_METRICS
    assert set(SUMMARY_COLUMNS) <= set(rollout_schema().names)


def test_jsonl_tail_reads_only_complete_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path, drop=("big",))
    assert tail.read() == []
    path.write_text('{"step": 1, "big": [1, 2]}\n{"step": 2')  # the last line is half-written
    assert tail.read() == [{"step": 1}]
    with path.open("a") as f:
        f.write(', "kl": 0.1}\nnot json\n{"step": 3}\n')
    assert tail.read() == [{"step": 1}, {"step": 2, "kl": 0.1}, {"step": 3}]
    path.write_text('{"step": 9}\n')  # replaced by a shorter file: start over
    assert tail.read() == [{"step": 9}]


def test_rollout_steps_come_in_step_order(tmp_path: Path) -> None:
    # Async steps overlap: step 1 may be done, and logged, before step 0.
    run = RunDir(tmp_path)
    run.layout.steps.parent.mkdir(parents=True)
    run.layout.steps.write_text(
        "\n".join(json.dumps({"step": k, "n": n}) for k, n in [(1, 0), (0, 1), (1, 2)]) + "\n"
    )
    assert [(r["step"], r["n"]) for r in run.rollout_steps()] == [(0, 1), (1, 0), (1, 2)]


def test_ref_round_trip_and_refusals() -> None:
    ref = Ref.parse("eval/20240101-x/demo-eval/-1/demo/test/0/0")
    assert ref == Ref("eval", "20240101-x", "demo-eval/-1/demo/test/0/0")
    assert str(ref) == "eval/20240101-x/demo-eval/-1/demo/test/0/0"
    for bad in ("train/../../etc/passwd", "other/x/y", "train//y", "train/x", "eval/.hidden/t"):
        assert Ref.parse(bad) is None, bad
    with pytest.raises(ValueError):
        RunDir(Path("/tmp")).trajectories(eval_id="../x")


def test_trajectories_by_step_eval_and_text(run: RunDir) -> None:
    everything = run.trajectories()
    train = run.trajectories(kind="train")
    evals = run.trajectories(kind="eval")
    assert len(everything) == len(train) + len(evals)
    assert len(evals) == 12 and {r["kind"] for r in evals} == {"eval"}
    assert {r["step"] for r in run.trajectories(step=2)} == {2}
    hits = run.trajectories(text="QUILLON")
    assert hits and all(
        "quillon" in (run.trajectory(Ref.parse(r["ref"]))["response_text"] + r["question"]).lower()
        for r in hits
    )
    first = run.trajectory(Ref.parse(train[0]["ref"]))
    assert first["trajectory_id"] == train[0]["trajectory_id"]
    assert isinstance(first["reward_components"], dict)
    assert run.trajectory(Ref("train", "step-000099", "x")) is None


def test_filters(run: RunDir) -> None:
    rows = run.trajectories()
    only = views.filter_rows(rows, views.Filters(finish="truncated"))
    assert only and {r["finish_reason"] for r in only} == {"truncated"}
    errs = views.filter_rows(rows, views.Filters(errors="yes"))
    clean = views.filter_rows(rows, views.Filters(errors="no"))
    assert errs and len(errs) + len(clean) == len(rows)
    assert all(r["num_invalid"] for r in views.filter_rows(rows, views.Filters(errors="invalid")))
    assert all(
        r["num_searches"] >= 3 for r in views.filter_rows(rows, views.Filters(searches="3+"))
    )
    high = views.filter_rows(rows, views.Filters(min_reward=0.5))
    assert all(r["reward"] >= 0.5 for r in high)
    assert views.filter_rows(rows, views.Filters(min_reward=2.0)) == []


def test_curves_merge_trainer_and_rollout_steps(run: RunDir) -> None:
    curves = views.curves(run)
    by_title = {p["title"]: p for p in curves["panels"]}
    reward = by_title["Reward / EM"]
    assert reward["data"][0] == [1, 2, 3, 4, 5]  # rollout steps 0..4 drawn at 1..5
    assert "rollout/reward_mean" in reward["labels"]
    assert all(len(series) == 5 for series in reward["data"])
    assert by_title["Held-out evaluations"]["labels"] == ["em"]
    assert curves["last_step"] == 5


def test_curves_of_an_empty_run(tmp_path: Path) -> None:
    assert views.curves(RunDir(tmp_path)) == {"panels": [], "last_step": None}


def test_demo_eval_summaries_without_a_rollout_log(tmp_path: Path) -> None:
    (tmp_path / "eval_before.json").write_text(json.dumps({"overall": {"em": 0.1}}))
    [e] = RunDir(tmp_path).evaluations()
    assert e["label"] == "eval_before" and e["eval_id"] == ""


def test_advantages_are_grpo_normalized() -> None:
    adv = views.advantages([1.0, 0.0, 0.0, 1.0])
    assert sum(adv) == pytest.approx(0.0)
    assert adv[0] == pytest.approx(0.5 / (0.5773502691896258 + 1e-6))
    assert views.advantages([1.0]) == [0.0]
    assert views.advantages([0.5, 0.5]) == [0.0, 0.0]


def test_step_view_and_compare(run: RunDir) -> None:
    view = views.step_view(run, 1)
    assert view is not None and len(view["groups"]) == 2
    assert view["trainer"]["step"] == 2
    assert all(ref for ref in view["groups"][0]["refs"])  # the logged group
    assert views.step_view(run, 42) is None
    evals = run.evaluations()
    result = views.compare(run, evals[0]["eval_id"], evals[1]["eval_id"])
    assert len(result["pairs"]) == 6
    assert result["improved"] + result["regressed"] <= 6
    deltas = [abs(p["delta"]) for p in result["pairs"]]
    assert deltas == sorted(deltas, reverse=True)  # changed questions first


def test_token_html_escapes_and_marks_spans() -> None:
    row = {
        "token_texts": ["<b>", "x", "<i>"],
        "rollout_logprobs": [-0.1, 0.0, -5.0],
        "has_rollout_logprobs": True,
        "spans": [
            {"kind": "model", "start": 0, "end": 1, "text": "<b>"},
            {"kind": "observation", "start": 1, "end": 2, "text": "x"},
            {"kind": "model", "start": 2, "end": 3, "text": "<i>"},
        ],
    }
    html = str(views.token_html(row))
    assert "<b>" not in html and "&lt;b&gt;" in html
    assert html.count('class="span obs"') == 1 and html.count('class="t ') == 2
    assert 'class="t l3" data-i="2"' in html
