"""A task in one file (docs/tasks.md's worked example; tests/unit/test_task_cli.py runs it).

Reach the target from 1 with `+1` and `*2`: each turn the policy writes one operation, the
environment answers with the new value. Reaching the target wins; passing it loses.

    searchr1 task check docs/examples/reach_task.py:ReachTask
    # stack.yaml: orchestrator: {task: {name: docs/examples/reach_task.py:ReachTask}}
"""

from __future__ import annotations

import random
import re

from orchestrator.sample import Prompt, Sample
from orchestrator.tasks import EnvStep, Episode, Split, Task

OP = re.compile(r"<op>\s*(\+1|\*2)\s*</op>")


class Reach(Episode):
    def __init__(self, target: int) -> None:
        self.target, self.value, self.moves = target, 1, 0

    async def step(self, action: str) -> EnvStep:
        op = OP.search(action)
        if op is None:  # the policy's mistake: say what is expected, no reward
            return EnvStep([{"role": "user", "content": "Write <op> +1 </op> or <op> *2 </op>."}])
        self.moves += 1
        self.value = self.value + 1 if op[1] == "+1" else self.value * 2
        if self.value >= self.target:  # reached (reward 1) or passed (0): the game ends
            return EnvStep(reward=float(self.value == self.target), done=True)
        return EnvStep([{"role": "user", "content": f"Now {self.value}."}])


class ReachTask(Task):
    name = "reach"
    description = "Reach a number from 1 with +1 and *2; the environment says where you are."
    stop = ["</op>"]  # one operation per message

    def rows(self, split: Split) -> list[Prompt]:
        rng = random.Random(split)  # fixed rows; the eval split differs from train
        return [
            Prompt(
                prompt_id=f"reach/{split}/{i}",
                data_source="reach",
                messages=[{"role": "user", "content": f"Reach {target} from 1 with +1 and *2."}],
                golds=[str(target)],
            )
            for i, target in enumerate(rng.randint(2, 40) for _ in range(64))
        ]

    def episode(self, prompt: Prompt) -> Episode:
        return Reach(int(prompt.golds[0]))

    def score(self, sample: Sample, episode: Episode) -> dict[str, float]:
        assert isinstance(episode, Reach)
        won = float(episode.value == episode.target)
        return {"reward": won, "em": won, "moves": float(episode.moves)}

    def demonstration(self, prompt: Prompt) -> list[str]:
        """The fewest moves, found backwards from the target."""
        n, ops = int(prompt.golds[0]), []
        while n > 1:
            ops.append("*2" if n % 2 == 0 and n // 2 >= 1 else "+1")
            n = n // 2 if ops[-1] == "*2" else n - 1
        return [f"<op> {op} </op>" for op in reversed(ops)]
