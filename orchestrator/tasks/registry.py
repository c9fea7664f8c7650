"""Tasks by name or dotted path, built and checked once at start-up.

`orchestrator.task.name` is a built-in's name (`BUILTIN_TASKS`, `searchr1 task list`) or a
dotted path `pkg.mod:Thing`: a `Task` subclass, or a function of the options returning a Task.
Whatever cannot be built (a typo, a wrong signature, a missing package, a task without train
rows) fails the start naming the field, as the other hooks do (orchestrator/hooks.py).
"""

from __future__ import annotations

from typing import Any

from orchestrator.config import TaskConfig
from orchestrator.hooks import HookError, load_hook
from orchestrator.tasks.base import Split, Task

# name -> dotted path: built-ins load like user tasks (only the chosen one is imported).
BUILTIN_TASKS: dict[str, str] = {
    "search-r1": "orchestrator.tasks.search_r1:SearchR1Task",
    "multi-tool": "orchestrator.tasks.multi_tool:MultiToolTask",
    "guess-number": "orchestrator.tasks.guess_number:GuessNumberTask",
    "reasoning-gym": "orchestrator.tasks.reasoning_gym:ReasoningGymTask",
    "skyrl-gym": "orchestrator.tasks.skyrl_gym:SkyRLGymTask",
}
FIELD = "orchestrator.task.name"


def task_path(name: str) -> str:
    """The dotted path of a built-in's name, or `name` itself when it is a path."""
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    if "." not in name and ":" not in name:
        raise HookError(
            f"{FIELD}: {name!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor a "
            "dotted path `pkg.mod:MyTask`"
        )
    return name


def load_task(cfg: TaskConfig) -> Task:
    """The task `cfg` names, built from its options."""
    make = load_hook(task_path(cfg.name), field=FIELD, n_args=1, is_async=False)
    try:
        task = make(dict(cfg.options))
    except (TypeError, ValueError, KeyError, OSError) as e:  # OSError: a missing program, file
        raise HookError(f"orchestrator.task.options ({cfg.name}): {e}") from e
    if not isinstance(task, Task):
        raise HookError(
            f"{FIELD}: {cfg.name!r} made {type(task).__name__}, not an orchestrator.tasks.Task"
        )
    return task


def task_rows(task: Task, split: Split, limit: int | None = None) -> list[Any]:
    """`task.rows(split)`, checked: a task without train rows cannot train."""
    try:
        rows = list(task.rows(split))
    except (ValueError, OSError) as e:  # a missing file, a bad row: the task's data is wrong
        raise HookError(f"task {task.name!r}: its {split} rows: {e}") from e
    if split == "train" and not rows:
        raise HookError(f"task {task.name!r}: no train rows")
    return rows[:limit] if limit else rows
