"""bench/guess_signal.py's game model: its strategies win what they should, and a warm start
that mixes binary search with a scan gives the first guess a stronger signal than random."""

from __future__ import annotations

import random

from bench.guess_signal import binary_search_success, random_legal, signal, strategies


def test_the_strategies_win_what_they_should() -> None:
    assert binary_search_success(16, 4) == 15 / 16  # 16 needs a fifth guess
    assert binary_search_success(8, 3) == 7 / 8
    scan = strategies(16, 4, 0.0)
    assert [scan(s, random.Random(0))[0] for s in range(1, 17)] == [1.0] * 4 + [0.0] * 12
    # random guesses among the numbers still allowed: a first guess of 8 is the good one
    won, _, p = random_legal(16, 16)(5, random.Random(0))
    assert won == 1.0 and p == 1 / 16


def test_a_choice_of_strategies_is_a_stronger_signal_than_random_guesses() -> None:
    _, weak = signal(random_legal(16, 4), 16, steps=40)
    success, strong = signal(strategies(16, 4, 0.3), 16, steps=40)
    assert strong > 2 * weak and strong > 2
    assert 0.35 < success < 0.55  # 0.3 * 15/16 + 0.7 * 4/16 = 0.456
