"""Tasks: the environments the orchestrator trains on (`Task`, docs/tasks.md)."""

from orchestrator.tasks.base import EnvStep, Episode, LoopTools, SingleTurn, Split, Task

__all__ = ["EnvStep", "Episode", "LoopTools", "SingleTurn", "Split", "Task"]
