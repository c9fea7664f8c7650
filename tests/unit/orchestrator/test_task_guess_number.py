"""guess-number's random demonstration: the rules without the strategy (what the demo's warm
start learns from, leaving binary search to RL)."""

from __future__ import annotations

import pytest

from orchestrator.config import TaskConfig
from orchestrator.hooks import HookError
from orchestrator.tasks.guess_number import GuessNumberTask, parse_guess
from orchestrator.tasks.registry import load_task


def test_random_demonstrations_guess_only_what_the_answers_allow_until_found() -> None:
    task = GuessNumberTask({"high": 16, "demonstration": "random"})
    lengths = []
    for prompt in task.rows("train")[:200]:
        secret, low, high = int(prompt.golds[0]), 1, 16
        moves = task.demonstration(prompt)
        guesses = [parse_guess(m) for m in moves]
        for g in guesses[:-1]:
            assert g is not None and low <= g <= high and g != secret
            low, high = (g + 1, high) if secret > g else (low, g - 1)
        assert guesses[-1] == secret and low <= secret <= high
        assert moves == task.demonstration(prompt)  # the row's own draw, every time
        lengths.append(len(moves))
    # Not binary search: some games take longer than its 5 guesses, and the first guess varies.
    assert max(lengths) > task.par
    assert len({task.demonstration(p)[0] for p in task.rows("train")[:200]}) > 8


def test_binary_search_stays_the_default_demonstration() -> None:
    task = GuessNumberTask({"high": 16})
    first = task.demonstration(task.rows("eval")[0])[0]
    assert parse_guess(first) == 8


def test_an_unknown_demonstration_fails_naming_the_option() -> None:
    with pytest.raises(HookError, match=r"options\.demonstration must be one of"):
        load_task(TaskConfig(name="guess-number", options={"demonstration": "linear"}))
