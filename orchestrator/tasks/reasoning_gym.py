"""`reasoning-gym`: any of reasoning-gym's procedural datasets as a single-turn task.

    task: {name: reasoning-gym, options: {dataset: chain_sum, train_size: 2000, seed: 0}}

Rows are the dataset's items (`reasoning_gym.create_dataset(name, size=, seed=, **config)`),
each question followed by an instruction to answer inside `<answer> </answer>`; the engine
stops on `</answer>`. The rubric is the dataset's own scorer, `score_answer(answer, item)`, on
the last `<answer>` block (reasoning-gym's `extract_answer`), so the reward is what the
dataset's authors defined.

Seeds: reasoning-gym draws a random seed for `seed=None`, so the seed is never None here. Its
items are generated from `Random(seed + index)`: seed s's item i is seed s+1's item i-1. Eval
therefore uses `seed + EVAL_SEED_OFFSET`, far past any train index, not `seed + 1` (which
would share all but one item with train).

Not carried over: the default scorer (`ProceduralDataset.score_answer`, and numeric ones such
as `compute_decimal_reward`) gives partial credit `len(gold) / len(answer)` when the gold is a
substring of the answer (the answer "-5" earns 0.5 against the gold "5"). The reward keeps
that (it is the dataset's definition); the `em` metric is the strict exact match, to tell the
two apart.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from orchestrator.sample import Prompt, Sample
from orchestrator.tasks.base import SPLITS, Episode, Split, Task

log = logging.getLogger(__name__)

INSTRUCTION = (
    "\n\nThink it through if you need to, then give only the final answer inside "
    "<answer> </answer>."
)
# Eval items come from seeds this far from train's (items are Random(seed + index)).
EVAL_SEED_OFFSET = 1_000_000_007
MISSING = "task reasoning-gym needs the package reasoning-gym (pip install 'searchr1[envs]')"


def exact(answer: str | None, gold: str) -> float:
    """1.0 when `answer` equals `gold` up to white space and case. Not SQuAD normalisation:
    that drops '-' and '.', and "-4" is not "4"."""
    if answer is None:
        return 0.0
    return float(" ".join(answer.split()).casefold() == " ".join(gold.split()).casefold())


class ReasoningGymTask(Task):
    name = "reasoning-gym"
    description = "A reasoning-gym dataset (single turn, <answer> tags), scored by its own scorer."
    stop: ClassVar[list[str] | None] = ["</answer>"]

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.check_options({"dataset", "train_size", "eval_size", "seed", "config"})
        try:
            import reasoning_gym
            from reasoning_gym.factory import DATASETS
            from reasoning_gym.utils import extract_answer
        except ImportError as e:
            raise ValueError(MISSING) from e
        self._extract = extract_answer
        dataset = self.options.get("dataset")
        if not dataset:
            raise ValueError("options.dataset (a reasoning-gym dataset name) is required")
        if dataset not in DATASETS:
            raise ValueError(
                f"options.dataset: reasoning-gym has no dataset {dataset!r} "
                f"({len(DATASETS)} known, e.g. {', '.join(sorted(DATASETS)[:5])})"
            )
        self.dataset = str(dataset)
        self.train_size = int(self.options.get("train_size", 1000))
        self.eval_size = int(self.options.get("eval_size", 100))
        if self.train_size < 1 or self.eval_size < 0:
            raise ValueError("options.train_size must be >= 1 and options.eval_size >= 0")
        if self.train_size > EVAL_SEED_OFFSET:
            raise ValueError(f"options.train_size must be <= {EVAL_SEED_OFFSET}")
        seed = self.options.get("seed", 0)
        if seed is None:  # reasoning-gym would draw a random one: rows would differ per run
            raise ValueError("options.seed must be a whole number, not null")
        self.seed = int(seed)
        config = self.options.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError("options.config must be a mapping of the dataset's settings")
        clash = {"size", "seed"} & set(config)
        if clash:
            raise ValueError(f"options.config: set {sorted(clash)} as options, not in config")
        self.config = dict(config)
        sizes = {"train": self.train_size, "eval": self.eval_size}
        seeds = {"train": self.seed, "eval": self.seed + EVAL_SEED_OFFSET}
        self._datasets: dict[str, Any] = {}
        for split in SPLITS:
            try:
                self._datasets[split] = reasoning_gym.create_dataset(
                    self.dataset, size=max(sizes[split], 1), seed=seeds[split], **self.config
                )
            except (TypeError, AssertionError, ValueError) as e:
                raise ValueError(f"options.config for {self.dataset!r}: {e}") from e
        self._sizes = sizes
        self._entries: dict[str, list[dict[str, Any]]] = {}

    def entries(self, split: Split) -> list[dict[str, Any]]:
        """The dataset's items of `split` (generated once: some generators are slow)."""
        if split not in self._entries:
            ds = self._datasets[split]
            self._entries[split] = [ds[i] for i in range(self._sizes[split])]
        return self._entries[split]

    def rows(self, split: Split) -> list[Prompt]:
        source = f"{self.name}/{self.dataset}"
        return [
            Prompt(
                prompt_id=f"{source}/{split}/{i}",
                data_source=source,
                messages=[{"role": "user", "content": str(entry["question"]) + INSTRUCTION}],
                golds=[str(entry["answer"])],
                metadata={"split": split, "index": str(i)},
            )
            for i, entry in enumerate(self.entries(split))
        ]

    def score(self, sample: Sample, episode: Episode) -> dict[str, float]:
        """The dataset's scorer on the last `<answer>` (partial credit included); `em` strict."""
        answer = self._extract(sample.response_text)
        split: Split = "eval" if sample.prompt.metadata.get("split") == "eval" else "train"
        entry = self.entries(split)[int(sample.prompt.metadata["index"])]
        try:
            reward = float(self._datasets[split].score_answer(answer, entry))
        except Exception:  # a scorer that chokes on odd text: the answer earns nothing
            log.warning("%s: score_answer raised on %r", self.dataset, answer, exc_info=True)
            reward = 0.0
        return {"reward": reward, "em": exact(answer, str(entry["answer"]))}

    def demonstration(self, prompt: Prompt) -> list[str]:
        """The gold answer in tags."""
        return [f"<answer> {prompt.golds[0]} </answer>"]
