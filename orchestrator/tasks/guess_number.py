"""`guess-number`: a game whose environment answers every turn, with a reward per turn.

The policy guesses a secret whole number in [1, high] as `<guess> N </guess>`; the environment
answers each guess as a user turn ("higher: 9 to 16", "lower: 1 to 7": the direction and the
numbers the answers so far leave; a right guess ends the game). A
guess that cannot be read is answered with the expected format. Rewards per turn: 1 for the
found number; `consistency_bonus` for a guess that the earlier answers still allow (inside
the interval they leave); `information_bonus` times the share of the game's bits (log2 of the
numbers left) a guess's answer removes, so a lost game that narrowed the secret down earns
part of it (a won game earns 1 + information_bonus whatever the path: the sum telescopes).
The rubric sums them, less a small cost per guess beyond the fewest binary search needs; its
`em` is the win alone. The rows are generated from a seed, the eval split disjoint from train.

Its scripted demonstration (`demonstration` option) is binary search; `random`: a guess drawn
uniformly from the numbers the answers so far leave, which follows the rules (the format, the
feedback) but not the strategy; `scan`: linear search, the lowest number still possible (the
first number of the last answer); or a mixture, `{binary-search: 0.3, scan: 0.7}`: each row
plays one of them, drawn with these weights from the row's id. A demo warm-started on the
mixture knows both strategies and mostly plays the worse one: RL has the choice to learn.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any, ClassVar

from orchestrator.sample import Prompt, Sample
from orchestrator.tasks.base import EnvStep, Episode, Split, Task

_GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")
INSTRUCTION = (
    "I am thinking of a whole number from 1 to {high}. Find it. Write each guess as "
    "<guess> N </guess>; after each guess I say higher or lower, and where it still can be."
)
DEMONSTRATIONS = ("binary-search", "random", "scan")
INVALID = "Write your guess as <guess> N </guess> with a whole number from 1 to {high}."


def parse_guess(text: str) -> int | None:
    """The last `<guess> N </guess>` of a message, or None."""
    found = _GUESS.findall(text)
    return int(found[-1]) if found else None


def demonstration_weights(value: Any) -> dict[str, float]:
    """`options.demonstration`: a strategy's name, or a mapping of names to positive weights."""
    weights = {value: 1.0} if isinstance(value, str) else value
    if not isinstance(weights, dict) or not weights:
        raise ValueError(
            "options.demonstration must be a strategy's name or a mapping of names to weights, "
            f"not {value!r}"
        )
    for name, weight in weights.items():
        if name not in DEMONSTRATIONS:
            raise ValueError(
                f"options.demonstration must be one of {', '.join(DEMONSTRATIONS)}, not {name!r}"
            )
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise ValueError(f"options.demonstration.{name}: a weight > 0, not {weight!r}")
    return {name: float(weight) for name, weight in weights.items()}


class GuessEpisode(Episode):
    def __init__(
        self,
        secret: int,
        high: int,
        consistency_bonus: float = 0.0,
        information_bonus: float = 0.0,
    ) -> None:
        self.secret, self.high = secret, high
        self.bonus = consistency_bonus
        self.information = information_bonus
        self.low, self.top = 1, high  # what the answers so far leave possible
        self.guesses = 0
        self.solved = False

    async def step(self, action: str) -> EnvStep:
        guess = parse_guess(action)
        if guess is None or not 1 <= guess <= self.high:
            return EnvStep(self._user(INVALID.format(high=self.high)), info={"invalid": 1.0})
        self.guesses += 1
        before = self._bits()
        if guess == self.secret:
            self.solved = True
            # the win learns the bits still missing: a won game earns 1 + information_bonus
            reward = 1.0 + self.information * before
            return EnvStep(reward=reward, done=True, info={"guesses": float(self.guesses)})
        consistent = self.low <= guess <= self.top
        if self.secret > guess:
            self.low = max(self.low, guess + 1)
        else:
            self.top = min(self.top, guess - 1)
        reward = (self.bonus if consistent else 0.0) + self.information * (before - self._bits())
        direction = "higher" if self.secret > guess else "lower"
        return EnvStep(self._user(f"{direction}: {self.low} to {self.top}"), reward=reward)

    def _bits(self) -> float:
        """What is still unknown, as a share of the game's bits: log2(numbers left) / log2(high)."""
        return math.log2(self.top - self.low + 1) / math.log2(self.high)

    @staticmethod
    def _user(text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": text}]


class GuessNumberTask(Task):
    name = "guess-number"
    description = "Guess a number from higher/lower feedback: the environment answers every turn."
    stop: ClassVar[list[str] | None] = ["</guess>"]

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.check_options(
            {
                "high",
                "train_size",
                "eval_size",
                "seed",
                "guess_cost",
                "consistency_bonus",
                "information_bonus",
                "demonstration",
            }
        )
        self.high = int(self.options.get("high", 16))
        if self.high < 2:
            raise ValueError("options.high must be >= 2")
        self.train_size = int(self.options.get("train_size", 512))
        self.eval_size = int(self.options.get("eval_size", 64))
        self.seed = int(self.options.get("seed", 0))
        self.guess_cost = float(self.options.get("guess_cost", 0.1))
        self.consistency_bonus = float(self.options.get("consistency_bonus", 0.0))
        self.information_bonus = float(self.options.get("information_bonus", 0.0))
        self.demonstrations = demonstration_weights(
            self.options.get("demonstration", "binary-search")
        )
        # The fewest guesses that always suffice (binary search).
        self.par = math.ceil(math.log2(self.high + 1))

    def rows(self, split: Split) -> list[Prompt]:
        # The prompt is the same for every game, so a policy is a fixed strategy and its
        # success is the share of the secrets it finds: eval games cover every secret equally
        # (64 random draws of 16 numbers weighed one secret 9 times, another once), in a
        # shuffled order; training games draw theirs at random.
        rng = random.Random(f"{self.seed}/{split}")
        size = self.train_size if split == "train" else self.eval_size
        if split == "train":
            secrets = [rng.randint(1, self.high) for _ in range(size)]
        else:
            secrets = [i % self.high + 1 for i in range(size)]
            rng.shuffle(secrets)
        content = INSTRUCTION.format(high=self.high)
        return [
            Prompt(
                prompt_id=f"{self.name}/{split}/{i}",
                data_source=self.name,
                messages=[{"role": "user", "content": content}],
                golds=[str(secret)],
                metadata={"split": split, "index": str(i)},
            )
            for i, secret in enumerate(secrets)
        ]

    def episode(self, prompt: Prompt) -> Episode:
        return GuessEpisode(
            int(prompt.golds[0]), self.high, self.consistency_bonus, self.information_bonus
        )

    def score(self, sample: Sample, episode: Episode) -> dict[str, float]:
        assert isinstance(episode, GuessEpisode)
        extra = max(0, episode.guesses - self.par)
        turns = sum(t.reward for t in sample.turns)
        reward = max(0.0, turns - self.guess_cost * extra)
        return {"reward": reward, "em": float(episode.solved), "guesses": float(episode.guesses)}

    def demonstration_policy(self, prompt: Prompt) -> str:
        """The strategy the row's demonstration plays (drawn from its id: the same every time)."""
        if len(self.demonstrations) == 1:
            return next(iter(self.demonstrations))
        rng = random.Random(f"{self.seed}/{prompt.prompt_id}/policy")
        names = list(self.demonstrations)
        return rng.choices(names, weights=[self.demonstrations[n] for n in names])[0]

    def demonstration(self, prompt: Prompt) -> list[str]:
        """The row's strategy played to its secret: binary search, random guesses among the
        numbers still possible (drawn from the row's id: the same every time), or a scan."""
        secret, low, high = int(prompt.golds[0]), 1, self.high
        policy = self.demonstration_policy(prompt)
        rng = random.Random(f"{self.seed}/{prompt.prompt_id}")
        messages = []
        while True:
            if policy == "random":
                guess = rng.randint(low, high)
            elif policy == "scan":
                guess = low
            else:
                guess = (low + high) // 2
            messages.append(f"<guess> {guess} </guess>")
            if guess == secret:
                return messages
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)
