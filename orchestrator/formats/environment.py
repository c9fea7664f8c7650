"""The environment format: a task's environment answers every model message
(orchestrator/tasks/base.py).

Each model message goes to the sample's `Episode.step` under a runner (the tools' own,
orchestrator/tools/runner.py): a deadline per turn, a cap on turns in flight, a breaker after
failures in a row, metrics labelled `env:<task>`. A turn is never retried: an episode holds
state, and a step that timed out may have changed it. An environment that raises or times out
ends the sample as an infrastructure failure (status error, left out of training, counted),
with the error on the turn.

The answer is appended token-exactly: chat messages as the model's chat template renders them
after the model's turn (its end-of-turn token added, loss mask 0, when the engine stopped before
it), a plain string as it is; each message's content cut to `observation_max_tokens`.
"""

from __future__ import annotations

import inspect
from typing import Any

from orchestrator.config import CallLimits, RolloutConfig, TurnSemantics
from orchestrator.formats.base import TurnHost
from orchestrator.formats.function_calling import ToolTurns, truncate
from orchestrator.observation import Observation, Tokenizer
from orchestrator.sample import Sample, Status, TurnRecord
from orchestrator.tasks.base import EnvStep, Episode, Task
from orchestrator.tools.metrics import RunnerMetrics
from orchestrator.tools.runner import Outcome, ToolRunner


class EnvTurns:
    """One task's episodes: made per sample, stepped per message, scored and closed at the
    end."""

    def __init__(
        self,
        task: Task,
        tokenizer: Tokenizer,
        limits: CallLimits,
        *,
        observation_max_tokens: int | None = None,
    ) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.observation_max_tokens = observation_max_tokens
        self.runner = ToolRunner(limits, RunnerMetrics(f"env:{task.name}"), service=task.name)
        self.turns = ToolTurns(tokenizer, task.tool_schemas(), role="user")
        self._episodes: dict[str, Episode] = {}

    tools_in_prompt = False  # the loop renders the task's prompt with them already

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        return self.task.tool_schemas() or None

    def stop(self, cfg: RolloutConfig) -> list[str]:
        return list(self.task.stop or [])

    async def act(
        self,
        host: TurnHost,
        sample: Sample,
        turn: TurnRecord,
        text: str,
        result: Any,
        max_new: int,
        room: int | None,
    ) -> bool:
        """The message goes to the episode, whose answer is appended unless the episode (or a
        limit) ends the sample here."""
        turn.action = "env"
        if result.finish_reason == "length" and host.cfg.turn_semantics == TurnSemantics.SLIME:
            sample.status = host.length_status(sample, len(result.output_ids), max_new, room)
            return True
        out = await self.step(sample, text)
        turn.tool_latency_s, turn.tool_attempts = out.latency_s, out.attempts
        sample.tool_s += out.latency_s
        if out.value is None:
            turn.error = out.error or "no answer"
            sample.status = Status.ERROR
            sample.error = f"environment {self.task.name!r}: {turn.error}"
            sample.infrastructure_failure = True
            return True
        answer = out.value
        turn.reward = float(answer.reward)
        if answer.done:
            sample.status = Status.ANSWERED
            return True
        stop = host.stop_before_observing(sample, turn.index, result, max_new, room)
        if stop is not None:
            sample.status = stop
            return True
        return host.observe(sample, turn, self.observation(text, answer))

    def episode(self, sample: Sample) -> Episode:
        """The sample's episode, made on its first turn."""
        ep = self._episodes.get(sample.trajectory_id)
        if ep is None:
            ep = self._episodes[sample.trajectory_id] = self.task.episode(sample.prompt)
        return ep

    async def step(self, sample: Sample, action: str) -> Outcome[EnvStep]:

        async def one() -> EnvStep:  # making the episode is the environment's work too
            return await self.episode(sample).step(action)

        out = await self.runner.run(one)
        if out.value is not None and not isinstance(out.value, EnvStep):
            kind = type(self.episode(sample)).__name__
            out.error = f"{kind}.step returned {out.value!r}, not an EnvStep"
            out.value = None
        return out

    def observation(self, turn_text: str, step: EnvStep) -> Observation:
        """The environment's answer as the ids appended after the model's message."""
        cap = self.observation_max_tokens
        if isinstance(step.observation, str):
            text = truncate(self.tokenizer, step.observation, cap)
        else:
            messages = [
                {**m, "content": truncate(self.tokenizer, str(m.get("content", "")), cap)}
                for m in step.observation
            ]
            text = self.turns.messages_text(turn_text, messages)
        return Observation(text, self.tokenizer.encode(text, add_special_tokens=False))

    async def finish(self, sample: Sample) -> None:
        """Score the sample by the task's rubric (its episode still open), then close it."""
        episode = self._episodes.pop(sample.trajectory_id, None)
        if episode is None:  # the sample ended before its first environment turn
            try:
                episode = self.task.episode(sample.prompt)
            except Exception as e:  # counted as the failed turn would have been
                sample.reward, sample.reward_components = 0.0, {}
                if sample.status is None or not sample.error:
                    sample.status, sample.infrastructure_failure = Status.ERROR, True
                    sample.error = f"environment {self.task.name!r}: episode(): {e!r}"
                return
        try:
            scored = self.task.score(sample, episode)
            if inspect.isawaitable(scored):
                scored = await scored
        finally:
            await episode.close()
        if not isinstance(scored, dict) or "reward" not in scored:
            raise ValueError(
                f"task {self.task.name!r}: score() returned {scored!r}; it must return a dict "
                'with "reward" (and any metrics)'
            )
        sample.reward = float(scored["reward"])
        sample.reward_components = {k: float(v) for k, v in scored.items() if k != "reward"}
