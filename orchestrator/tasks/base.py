"""The Task interface: the one object a user writes to train on an environment of their own.

A task is four things (docs/tasks.md):
- its data: `rows(split)`, the prompts of the train and eval splits (`Prompt`: id, first
  messages, gold answers);
- how a row starts: the row's messages, rendered by the model's chat template (with
  `tool_schemas()` when the task has tools for the template to show);
- the environment's turn: `episode(prompt)` makes one `Episode` per sample, whose async
  `step(action)` reads the model's message and answers with an `EnvStep` (what the policy reads
  next, this turn's reward, whether the episode is over). A single-turn task keeps the default:
  the first message ends the episode;
- its rubric: `score(sample, episode)`, the final reward and the metrics recorded with it.

The loop keeps its guarantees around every task (orchestrator/rollout.py): token-exact ids
(the model's own ids, the environment's answer tokenized once with loss mask 0), the rollout's
turn and token limits, a deadline on every environment turn, a breaker, counted failures, the
rollout log and the inspector. An environment that raises is the environment's trouble (the
sample ends as an infrastructure failure, left out of training, counted), never the policy's.

Tasks whose environment is a set of tools the loop already serves (Search-R1's tags, the
chat template's function calling) set `loop_tools` instead of writing an episode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from orchestrator.config import ActionFormat, ToolConfig
from orchestrator.sample import Prompt, Sample

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")


@dataclass
class EnvStep:
    """The environment's answer to one model message.

    `observation`: what the policy reads next. Chat messages (`[{"role": "user", "content":
    ...}]`, or `tool` turns) are rendered by the model's chat template; a plain string is
    appended as it is (a tag format's `<information>` block). Ignored once `done`."""

    observation: str | list[dict[str, Any]] = ""
    reward: float = 0.0
    done: bool = False
    # Numbers about this turn that the rubric may use (e.g. {"valid": 1.0}).
    info: dict[str, float] = field(default_factory=dict)


class Episode(ABC):
    """One sample's environment: made by `Task.episode`, stepped once per model message,
    closed when the sample ends (whatever the reason)."""

    @abstractmethod
    async def step(self, action: str) -> EnvStep:
        """Answer the model's message `action` (its text, as generated, stop string included)."""

    async def close(self) -> None:  # noqa: B027 - optional: most episodes hold nothing
        """Release what the episode holds (a game server's session, a connection)."""


class SingleTurn(Episode):
    """The default episode: the first message is the answer; the rubric scores it."""

    async def step(self, action: str) -> EnvStep:
        return EnvStep(done=True)


@dataclass(frozen=True)
class LoopTools:
    """A task served by the loop's own tool formats (`rollout.action_format`, `rollout.tools`)."""

    action_format: ActionFormat
    tools: list[ToolConfig]


def steps_episodes(task: Task | None) -> bool:
    """Whether `task`'s samples step episodes (and its rubric scores them): a task that does
    not serve its environment through the loop's tools."""
    return task is not None and task.loop_tools is None


class Task(ABC):
    """Subclass, set `name`, implement `rows`; add `episode` for an environment that answers
    each turn and `score` for a rubric. Built from `orchestrator.task.options`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # What the engine stops on. None: the end of the model's turn (its end-of-turn token), so
    # each message reaches the environment whole; a tag format lists its closing tags.
    stop: ClassVar[list[str] | None] = None
    # Set for tasks whose environment is the loop's tools (Search-R1, multi-tool); per instance
    # where the tools depend on the options (multi-tool's calculator command).
    loop_tools: LoopTools | None = None

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    def check_options(self, known: set[str]) -> None:
        """ValueError naming the options a task does not take (a typo is not silently ignored)."""
        unknown = set(self.options) - known
        if unknown:
            names = ", ".join(sorted(known))
            raise ValueError(f"unknown options {sorted(unknown)} (known: {names})")

    @abstractmethod
    def rows(self, split: Split) -> list[Prompt]:
        """The prompts of `split` ("train" or "eval"), in a fixed order."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        """Function schemas the chat template shows the model (OpenAI's format); none by
        default."""
        return []

    def episode(self, prompt: Prompt) -> Episode:
        """A fresh environment for one sample of `prompt`."""
        return SingleTurn()

    def score(self, sample: Sample, episode: Episode) -> dict[str, float]:
        """The rubric, called once the episode ends (before it is closed, so it may read the
        episode's state): `{"reward": the scalar trained on, **metrics}`. Default: the sum of
        the environment's turn rewards. May be `async def`."""
        return {"reward": float(sum(t.reward for t in sample.turns))}

    def demonstration(self, prompt: Prompt) -> list[str]:
        """A scripted policy's messages for `prompt` (`searchr1 task check` plays them, a demo
        warm-starts on them). Tasks without one raise NotImplementedError."""
        raise NotImplementedError(f"task {self.name!r} has no scripted demonstration")
