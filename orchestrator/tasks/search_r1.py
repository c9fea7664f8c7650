"""`search-r1`: the recipe's own task as a Task. Its rows are Search-R1 parquet/JSONL rows
(spec section 1); its environment is the loop's search tool in Search-R1's tags; its reward is
`orchestrator.reward` (EM by default). With `orchestrator.task` unset, the orchestrator runs
exactly this over `orchestrator.data`; set, the same over the task's options:

    task: {name: search-r1, options: {train_path: data/train.parquet, val_path: data/test.parquet}}

Token-identical to the unset path (tests/unit/orchestrator/test_tasks.py).
"""

from __future__ import annotations

from typing import Any

from orchestrator.config import ActionFormat, ToolConfig
from orchestrator.data import load_prompts
from orchestrator.sample import Prompt
from orchestrator.tasks.base import LoopTools, Split, Task


class SearchR1Task(Task):
    name = "search-r1"
    description = "Search-R1: <search>/<answer> tags, the retriever as the one tool, EM reward."
    loop_tools = LoopTools(ActionFormat.SEARCH_R1, [ToolConfig(name="search")])

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.check_options({"train_path", "val_path", "max_prompts"})
        if not self.options.get("train_path"):
            raise ValueError("options.train_path (Search-R1 rows) is required")

    def rows(self, split: Split) -> list[Prompt]:
        if split == "train":
            return load_prompts(self.options["train_path"], self.options.get("max_prompts"))
        path = self.options.get("val_path")
        return load_prompts(path) if path else []

    def demonstration(self, prompt: Prompt) -> list[str]:
        """Search for the question, then answer with the first gold answer."""
        question = prompt.messages[-1]["content"].rsplit("Question:", 1)[-1].strip()
        return [
            f"<think> I need to look this up. </think>\n<search> {question} </search>",
            f"<think> I found it. </think>\n<answer> {prompt.golds[0]} </answer>",
        ]
