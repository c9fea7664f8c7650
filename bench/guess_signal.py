"""How strong GRPO's signal is for guess-number's first guess, under a warm start's policy.

A Monte Carlo model of the game, no model or services: each step plays `groups` groups of
`group_size` games (a group shares its secret, as a row's samples do), normalises the rewards
within each group (GRPO's advantages) and sums, over the first guesses, the score-function
gradient of the logit of the good first guess: (1[good] - p_good) * advantage. Its mean over
steps divided by its spread is the signal-to-noise ratio of one step. A warm start is a
policy over strategies: `random` (uniform among the numbers the answers still allow, runs
8-10's demonstrations), or a mixture of binary search and a scan (the lowest number still
possible) chosen by the first guess and kept for the game (run 11's).

    python -m bench.guess_signal [--steps 200]

Prints one line per design: the policy's sampled success, binary search's, the first guess's
signal-to-noise ratio per step.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

# (secret, rng) -> (won, first guess good, p_good)
Game = Callable[[int, random.Random], tuple[float, bool, float]]


def random_legal(high: int, turns: int) -> Game:
    """Uniform among the numbers still possible; the good first guess is the midpoint."""

    def play(secret: int, rng: random.Random) -> tuple[float, bool, float]:
        low, top, first = 1, high, None
        for _ in range(turns):
            guess = rng.randint(low, top)
            first = guess if first is None else first
            if guess == secret:
                break
            low, top = (guess + 1, top) if secret > guess else (low, guess - 1)
        return float(guess == secret), first == (1 + high) // 2, 1 / high

    return play


def strategies(high: int, turns: int, p_binary: float) -> Game:
    """Binary search w.p. `p_binary` (its first guess is the good one), else a scan."""

    def play(secret: int, rng: random.Random) -> tuple[float, bool, float]:
        binary = rng.random() < p_binary
        low, top = 1, high
        for _ in range(turns):
            guess = (low + top) // 2 if binary else low
            if guess == secret:
                return 1.0, binary, p_binary
            low, top = (guess + 1, top) if secret > guess else (low, guess - 1)
        return 0.0, binary, p_binary

    return play


def binary_search_success(high: int, turns: int) -> float:
    play = strategies(high, turns, 1.0)
    return statistics.fmean(play(s, random.Random())[0] for s in range(1, high + 1))


def signal(
    game: Game, high: int, steps: int, groups: int = 16, size: int = 8
) -> tuple[float, float]:
    """(sampled success, the first guess's signal-to-noise ratio per step)."""
    rng = random.Random(0)
    wins: list[float] = []
    grads: list[float] = []
    for _ in range(steps):
        grad = 0.0
        for _ in range(groups):
            secret = rng.randint(1, high)
            games = [game(secret, rng) for _ in range(size)]
            rewards = [won for won, _, _ in games]
            mean, spread = statistics.fmean(rewards), statistics.pstdev(rewards)
            wins += rewards
            if spread > 0:
                grad += sum((good - p) * (r - mean) / spread for r, good, p in games)
        grads.append(grad)
    return statistics.fmean(wins), statistics.fmean(grads) / statistics.pstdev(grads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    designs: list[tuple[str, int, int, Game]] = [
        ("random, high 16, 4 guesses", 16, 4, random_legal(16, 4)),
        ("random, high 8, 3 guesses", 8, 3, random_legal(8, 3)),
    ]
    for p in (0.1, 0.3):
        name = f"binary search {p} / scan {1 - p:.1f}, high 16, 4 guesses"
        designs.append((name, 16, 4, strategies(16, 4, p)))
    keys = ["random16", "random8", "mix10", "mix30"]  # the designs' names in the last line
    summary = []
    for key, (name, high, turns, game) in zip(keys, designs, strict=True):
        success, snr = signal(game, high, args.steps)
        best = binary_search_success(high, turns)
        print(f"{name}: sampled {success:.3f}, binary search {best:.3f}, first guess SNR {snr:.2f}")
        summary.append(f"{key}_success={success:.3f} {key}_snr={snr:.2f}")
    print(" ".join(summary))


if __name__ == "__main__":
    main()
