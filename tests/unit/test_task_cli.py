"""`searchr1 task list` and `searchr1 task check`: the commands a task's author runs first."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from stack.task_cli import app


def test_list_shows_the_built_ins_and_the_adapters() -> None:
    out = CliRunner().invoke(app, ["list"], terminal_width=200)
    assert out.exit_code == 0, out.output
    for name in ("search-r1", "guess-number", "reasoning-gym", "skyrl-gym"):
        assert name in out.output
    assert "cannot load" not in out.output


def test_check_plays_the_demonstration_and_prints_ids_with_their_masks(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    args = [
        "check",
        "guess-number",
        "--options",
        '{"high": 16}',
        "--tokenizer",
        str(tiny_model_dir),
    ]
    out = CliRunner().invoke(app, args, terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "loss mask" in out.output
    # Row 0's secret takes 4 binary-search guesses: 3 answered turns (mask 0) between them.
    assert "turn_rewards=[0.0, 0.0, 0.0, 1.0]" in out.output
    assert "│ 0         │" in out.output and "│ 1         │" in out.output
    assert "status=answered" in out.output and "reward=1.0" in out.output


def test_check_names_what_is_wrong() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["check", "chess"])
    assert out.exit_code == 2 and "neither a built-in task" in out.output
    out = runner.invoke(app, ["check", "guess-number", "--options", "{high: 3}"])
    assert out.exit_code == 2 and "--options: not JSON" in out.output
    out = runner.invoke(app, ["check", "search-r1", "--options", '{"train_path": "nope.jsonl"}'])
    assert out.exit_code == 2 and "dataset file not found" in out.output


def test_the_worked_example_of_docs_tasks_runs(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """docs/tasks.md's task in one file, named by its path: rows, episode, rubric, demo."""
    example = Path(__file__).resolve().parents[2] / "docs" / "examples" / "reach_task.py"
    args = ["check", f"{example}:ReachTask", "--row", "3", "--tokenizer", str(tiny_model_dir)]
    out = CliRunner().invoke(app, args, terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "status=answered" in out.output and "reward=1.0" in out.output
    assert '"em": 1.0' in out.output
