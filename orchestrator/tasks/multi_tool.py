"""`multi-tool`: search + arithmetic in the chat template's function-calling format, the
calculator served by an MCP server (PyPI's `mcp-server-calculator`, its tool `calculate`).

Rows are Search-R1 rows (parquet or JSON lines: `prompt`, `reward_model.ground_truth.target`),
e.g. the demo's questions "How many years apart were "X" and "Y" born?" over a corpus of
people with their birth years (demos/multitool.py writes them). The retriever serves the
corpus as for Search-R1; the reward is `orchestrator.reward` (EM of the last `<answer>` by
default). A solving trajectory: two `search` calls in one message, one `calculate` call on
"<year X> - <year Y>", then `<answer> N </answer>`; set `orchestrator.rollout.max_turns: 3`.

    task: {name: multi-tool, options: {train_path: data/train.jsonl, val_path: data/test.jsonl}}

Without the MCP server the task refuses to start, naming the package: the demo used to fall
back to the built-in calculator silently, so a user could not tell which tool the policy
learned to call.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from orchestrator.config import ActionFormat, ToolConfig
from orchestrator.data import load_prompts
from orchestrator.sample import Prompt
from orchestrator.tasks.base import LoopTools, Split, Task

CALCULATOR_SERVER = "mcp-server-calculator"
MCP_CALCULATOR = "calculate"  # the server's tool: the name the policy calls


def calculator_command(given: str | None = None) -> str:
    """The MCP calculator's command: `given`, else the one installed next to this interpreter
    (a virtualenv's bin/ is often not on PATH), else the one on PATH. FileNotFoundError naming
    the package when there is none."""
    if given:
        found = shutil.which(given)
        if found is None:
            raise FileNotFoundError(f"options.calculator_command: {given!r} is not a program")
        return found
    beside = Path(sys.executable).parent / CALCULATOR_SERVER
    command = str(beside) if beside.exists() else shutil.which(CALCULATOR_SERVER)
    if not command:
        raise FileNotFoundError(
            f"the multi-tool task needs the MCP server {CALCULATOR_SERVER!r} (PyPI "
            f"mcp-server-calculator; it needs mcp<2: `pip install mcp-server-calculator`, or "
            f"`python3 dev.py setup`, which installs it) next to {sys.executable} or on PATH"
        )
    return command


def calculator_tool(command: str) -> dict[str, Any]:
    """The `rollout.tools` entry of the MCP calculator (only its `calculate` tool)."""
    return {"name": "calc", "mcp": {"command": [command], "include": [MCP_CALCULATOR]}}


class MultiToolTask(Task):
    name = "multi-tool"
    description = (
        "search + an MCP calculator (mcp-server-calculator) in function calling; EM reward."
    )

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.check_options({"train_path", "val_path", "max_prompts", "calculator_command"})
        if not self.options.get("train_path"):
            raise ValueError("options.train_path (Search-R1 rows) is required")
        calculator = calculator_tool(calculator_command(self.options.get("calculator_command")))
        self.loop_tools = LoopTools(
            ActionFormat.FUNCTION_CALLING,
            [ToolConfig(name="search"), ToolConfig.model_validate(calculator)],
        )

    def rows(self, split: Split) -> list[Prompt]:
        if split == "train":
            return load_prompts(self.options["train_path"], self.options.get("max_prompts"))
        path = self.options.get("val_path")
        return load_prompts(path) if path else []

    def demonstration(self, prompt: Prompt) -> list[str]:
        """Search both names in one message, subtract, answer with the first gold answer (the
        years are not known without the retriever: the calculation is "0 + gold")."""
        names = re.findall(r'"([^"]+)"', prompt.messages[-1]["content"]) or ["?", "?"]
        searches = "\n".join(_call("search", {"query": n}) for n in names[:2])
        return [
            searches,
            _call(MCP_CALCULATOR, {"expression": f"0 + {prompt.golds[0]}"}),
            f"<answer> {prompt.golds[0]} </answer>",
        ]


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
