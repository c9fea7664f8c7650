"""guess-number's random demonstration: the rules without the strategy (what the demo's warm
start learns from, leaving binary search to RL)."""

from __future__ import annotations

import asyncio
import math

import pytest

from orchestrator.config import TaskConfig
from orchestrator.hooks import HookError
from orchestrator.tasks.guess_number import GuessEpisode, GuessNumberTask, parse_guess
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


def play(episode: GuessEpisode, guesses: list[int]) -> list[float]:
    async def go() -> list[float]:
        return [(await episode.step(f"<guess> {g} </guess>")).reward for g in guesses]

    return asyncio.run(go())


def test_the_information_bonus_pays_the_bits_an_answer_removes() -> None:
    # 16 numbers: 4 bits. 8 leaves 1..7 (log2 16/7 bits), 12 was excluded (nothing learned).
    rewards = play(GuessEpisode(5, 16, information_bonus=0.5), [8, 12, 4])
    assert rewards[0] == pytest.approx(0.5 * math.log2(16 / 7) / 4)
    assert rewards[1] == 0.0
    assert rewards[2] == pytest.approx(0.5 * math.log2(7 / 3) / 4)  # 5..7 left
    # A lost game earns the share it narrowed down; a won game 1 + the bonus, whatever the path.
    assert sum(rewards) == pytest.approx(0.5 * math.log2(16 / 3) / 4)
    for path in ([5], [8, 4, 6, 5], [1, 2, 3, 4, 5]):
        assert sum(play(GuessEpisode(5, 16, information_bonus=0.5), path)) == pytest.approx(1.5)


def test_scan_demonstrations_guess_the_lowest_number_still_possible() -> None:
    task = GuessNumberTask({"high": 16, "demonstration": "scan"})
    for prompt in task.rows("train")[:20]:
        secret = int(prompt.golds[0])
        assert [parse_guess(m) for m in task.demonstration(prompt)] == list(range(1, secret + 1))


def test_a_mixture_plays_one_strategy_per_row_with_its_weights() -> None:
    task = GuessNumberTask({"high": 16, "demonstration": {"binary-search": 0.3, "scan": 0.7}})
    binary = GuessNumberTask({"high": 16})
    scan = GuessNumberTask({"high": 16, "demonstration": "scan"})
    rows = task.rows("train")
    policies = [task.demonstration_policy(p) for p in rows]
    assert set(policies) == {"binary-search", "scan"}
    assert 0.25 < policies.count("binary-search") / len(rows) < 0.35  # 512 draws of 0.3
    for p, policy in zip(rows[:50], policies, strict=False):
        expected = binary if policy == "binary-search" else scan
        assert task.demonstration(p) == expected.demonstration(p)
        assert task.demonstration_policy(p) == policy  # the row's own draw, every time


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({"binary-search": 0.3, "linear": 0.7}, r"one of binary-search, random, scan, not .lin"),
        ({"scan": 0}, r"options\.demonstration\.scan: a weight > 0, not 0"),
        ({"scan": "much"}, r"options\.demonstration\.scan: a weight > 0"),
        ({}, r"a strategy's name or a mapping"),
        (3, r"a strategy's name or a mapping"),
    ],
)
def test_a_bad_mixture_fails_naming_the_option(value: object, error: str) -> None:
    with pytest.raises(HookError, match=error):
        load_task(TaskConfig(name="guess-number", options={"demonstration": value}))
