"""A Task's rows and rubric for `searchr1 agent run --task NAME` (docs/gateway.md).

The rows are the task's (`Task.rows(split)`), each handed to the agent program as a dict.
When the program returns no reward, the session is scored here, in the runner, on the text
the policy generated as the gateway recorded it (`GET /v1/sessions/<id>`: the last segment's
response decoded from its ids, and each model message of it):
- a task that steps episodes: the model's messages are played through a fresh
  `task.episode(row)` (the default `SingleTurn` ends at the first), its turn rewards recorded,
  then `Task.score(sample, episode)`;
- a `loop_tools` task: the orchestrator's reward function (`Scorer` over `RewardConfig`, EM of
  the last `<answer>` by default) on the whole response, as the orchestrator scores it.
A rubric (or an episode) that raises is `RubricError`: the runner ends the session without a
reward, so it is dead-lettered and counted, never trained on as a 0.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from orchestrator.config import RewardConfig, TaskConfig
from orchestrator.hooks import HookError
from orchestrator.sample import Prompt, Sample, Status, TurnRecord
from orchestrator.scoring import Scorer
from orchestrator.tasks.base import SPLITS, Split, Task
from orchestrator.tasks.registry import FIELD, load_task, task_rows

TASK_FIELD = "agent.task (--task)"


class RubricError(Exception):
    """The task's rubric (or its episode) failed on a session."""


class TaskRubric:
    """One task's rows (as dicts for the program) and its scoring of finished sessions."""

    def __init__(self, task: Task, reward: RewardConfig | None = None) -> None:
        self.task = task
        self.scorer = Scorer(reward or RewardConfig()) if task.loop_tools is not None else None
        self._prompts: dict[str, Prompt] = {}

    @classmethod
    def load(cls, name: str, options: dict[str, Any] | None = None) -> TaskRubric:
        """ValueError naming `--task` / `--task-options` when the task cannot be built."""
        try:
            task = load_task(TaskConfig(name=name, options=dict(options or {})))
        except HookError as e:  # it names the orchestrator's fields: here they are ours
            msg = str(e).replace(FIELD, TASK_FIELD)
            msg = msg.replace("orchestrator.task.options", "--task-options")
            if TASK_FIELD not in msg and "--task-options" not in msg:
                msg = f"{TASK_FIELD}: {msg}"
            raise ValueError(msg) from None
        return cls(task)

    def rows(self, split: str = "train", limit: int | None = None) -> list[dict[str, Any]]:
        if split not in SPLITS:
            raise ValueError(f"--split: {split!r} is not one of {', '.join(SPLITS)}")
        try:
            prompts = task_rows(self.task, split_of(split), limit)
        except HookError as e:
            raise ValueError(f"{TASK_FIELD}: {e}") from None
        rows = []
        for p in prompts:
            self._prompts[p.prompt_id] = p
            rows.append(row_of(p))
        return rows

    async def score(
        self, row: dict[str, Any], session: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        """(reward, components) of a session (`GET /v1/sessions/<id>`'s body) on `row`."""
        prompt = self._prompts[str(row["id"])]
        sample = Sample(
            prompt=prompt,
            group_id=str(session.get("group_id", "")),
            sample_index=0,
            group_size=1,
            prompt_ids=[],
            response_text=str(session.get("response_text", "")),
            status=Status.ANSWERED,
        )
        try:
            if self.scorer is not None:
                await self.scorer.score_group([sample])
                return sample.reward, dict(sample.reward_components)
            scored = await self._rubric(sample, [str(t) for t in session.get("turn_texts", [])])
        except Exception as e:
            raise RubricError(f"task {self.task.name!r}: {type(e).__name__}: {e}") from e
        reward = scored.get("reward") if isinstance(scored, dict) else None
        if not isinstance(reward, int | float) or not math.isfinite(reward):
            raise RubricError(
                f"task {self.task.name!r}: the rubric gave {scored!r:.200}, no finite reward"
            )
        components = {
            k: float(v)
            for k, v in scored.items()
            if k != "reward" and isinstance(v, int | float) and math.isfinite(v)
        }
        return float(reward), components

    async def _rubric(self, sample: Sample, messages: list[str]) -> Any:
        """The model's messages through a fresh episode, then `Task.score`."""
        episode = self.task.episode(sample.prompt)
        try:
            for i, text in enumerate(messages):
                step = await episode.step(text)
                sample.turns.append(TurnRecord(index=i, action="answer", reward=float(step.reward)))
                if step.done:
                    break
            scored = self.task.score(sample, episode)
            if inspect.isawaitable(scored):
                scored = await scored
            return scored
        finally:
            await episode.close()


def split_of(split: str) -> Split:
    return "eval" if split == "eval" else "train"


def row_of(p: Prompt) -> dict[str, Any]:
    """What the program gets: the row's id, messages, question text and golds."""
    first_user = next((m.get("content", "") for m in p.messages if m.get("role") == "user"), "")
    return {
        "id": p.prompt_id,
        "data_source": p.data_source,
        "messages": [dict(m) for m in p.messages],
        "question": p.metadata.get("question", first_user),
        "golds": list(p.golds),
        "metadata": dict(p.metadata),
    }
