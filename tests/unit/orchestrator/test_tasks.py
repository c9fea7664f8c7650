"""The Task interface: an environment that answers every turn, token by token; its failures;
tasks loaded by name and by dotted path; the built-in guess-number game."""

from __future__ import annotations

import asyncio
import collections
import sys
import textwrap

import pytest

from orchestrator.config import RolloutConfig, TaskConfig
from orchestrator.formats.environment import EnvTurns
from orchestrator.hooks import HookError
from orchestrator.prompt import prompt_token_ids
from orchestrator.rollout import Rollout
from orchestrator.sample import Status, new_group
from orchestrator.scoring import Scorer
from orchestrator.tasks.base import EnvStep, Episode, Task
from orchestrator.tasks.guess_number import GuessNumberTask, parse_guess
from orchestrator.tasks.registry import BUILTIN_TASKS, load_task
from orchestrator.tokenizer import rust_tokenizer
from orchestrator.tools.metrics import TOOL_FAILURES
from orchestrator.tools.toolbox import Toolbox
from tests.unit.orchestrator.conftest import ScriptedEngine


def make(tokenizer, task: Task, turns: list[str], *, step_timeout_s: float = 5.0, **cfg):  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, turns)
    fast = rust_tokenizer(tokenizer)
    limits = TaskConfig(name=task.name, limits={"timeout_s": step_timeout_s}).limits
    env = EnvTurns(task, fast, limits)
    rollout = Rollout(RolloutConfig(**cfg), engine, Toolbox([]), fast, env=env)
    prompt = task.rows("train")[0]
    ids = rollout.prompt_ids(prompt.messages)
    [s] = new_group(prompt, ids, group_size=1, rollout_step=0, run_id="r")
    return engine, rollout, s


def user_turn(tokenizer, turn_text: str, content: str) -> str:  # type: ignore[no-untyped-def]
    """What the chat template puts after an assistant message and before the next one."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x00"}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*base, {"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    assert after.startswith(before)
    tail = before[before.index("\x00") + 1 :]  # end of the assistant turn (not emitted: stop)
    return tail + after[len(before) :]


def secret_task(secret: int, **options) -> GuessNumberTask:  # type: ignore[no-untyped-def]
    task = GuessNumberTask({"high": 16, "train_size": 50, **options})
    rows = task.rows("train")
    index = next(i for i, p in enumerate(rows) if int(p.golds[0]) == secret)
    first = rows[index]
    task.rows = lambda split: [first]  # type: ignore[method-assign]
    return task


async def test_an_environment_that_answers_every_turn_is_token_exact(tokenizer) -> None:  # type: ignore[no-untyped-def]
    task = secret_task(5)
    turns = ["<guess> 8 </guess>", "<guess> 4 </guess>", "<guess> 5 </guess>"]
    engine, rollout, s = make(tokenizer, task, turns, max_turns=6)
    await rollout.run_sample(s)
    assert s.status == Status.ANSWERED
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
    obs = [
        tokenizer.encode(user_turn(tokenizer, turns[i], word), add_special_tokens=False)
        for i, word in enumerate(["lower: 1 to 7", "higher: 5 to 7"])
    ]
    assert s.response_ids == ids[0] + obs[0] + ids[1] + obs[1] + ids[2]
    assert s.loss_mask == (
        [1] * len(ids[0]) + [0] * len(obs[0]) + [1] * len(ids[1]) + [0] * len(obs[1])
    ) + [1] * len(ids[2])
    assert tokenizer.decode(s.response_ids) == s.response_text
    # Each call's context is the previous one plus what was appended: nothing re-tokenized.
    assert engine.calls[1]["input_ids"] == s.prompt_ids + ids[0] + obs[0]
    assert engine.calls[0]["stop"] == ["</guess>"]
    assert [t.action for t in s.turns] == ["env", "env", "env"]
    assert [t.reward for t in s.turns] == [0.0, 0.0, 1.0]
    # The rubric: found in 3 guesses, within binary search's 5: the full reward.
    assert s.reward == 1.0
    assert s.reward_components == {"em": 1.0, "guesses": 3.0}
    # The prompt is the chat template's rendering of the row (no tools).
    assert s.prompt_ids == prompt_token_ids(tokenizer, task.rows("train")[0].messages)


async def test_unreadable_guesses_are_answered_and_wasted_guesses_cost(tokenizer) -> None:  # type: ignore[no-untyped-def]
    task = secret_task(16, guess_cost=0.25)
    turns = ["no idea", *(f"<guess> {n} </guess>" for n in (1, 2, 3, 4, 5, 6, 16))]
    _, rollout, s = make(tokenizer, task, turns, max_turns=8, max_response_tokens=4096)
    await rollout.run_sample(s)
    assert "Write your guess as <guess> N </guess>" in s.response_text
    assert s.status == Status.ANSWERED
    assert s.reward_components == {"em": 1.0, "guesses": 7.0}
    assert s.reward == pytest.approx(1.0 - 0.25 * 2)  # 7 guesses, 5 suffice


async def test_the_turn_limit_ends_an_unsolved_game_with_no_reward(tokenizer) -> None:  # type: ignore[no-untyped-def]
    task = secret_task(16)
    engine, rollout, s = make(tokenizer, task, ["<guess> 1 </guess>"], max_turns=3)
    await rollout.run_sample(s)
    assert s.status == Status.MAX_TURNS
    assert len(engine.calls) == 3
    assert s.reward == 0.0 and s.reward_components["em"] == 0.0
    assert s.loss_mask[-1] == 1  # the last guess is the model's; nothing appended after it


class Raising(Task):
    name = "raising"

    def __init__(self, options=None, *, failure: str = "raise") -> None:  # type: ignore[no-untyped-def]
        super().__init__(options)
        self.failure = failure
        self.closed = 0

    def rows(self, split):  # type: ignore[no-untyped-def]
        return GuessNumberTask({"train_size": 1}).rows(split)

    def episode(self, prompt):  # type: ignore[no-untyped-def]
        task = self
        if self.failure == "no episode":
            raise ConnectionError("game server refused the session")

        class Broken(Episode):
            async def step(self, action: str) -> EnvStep:
                if task.failure == "hang":
                    await asyncio.sleep(30)
                if task.failure == "wrong type":
                    return "higher"  # type: ignore[return-value]
                raise RuntimeError("game server gone")

            async def close(self) -> None:
                task.closed += 1

        return Broken()


@pytest.mark.parametrize(
    ("failure", "error"),
    [
        ("raise", "RuntimeError: game server gone"),
        ("hang", "timed out after 0.2s"),
        ("wrong type", "returned 'higher', not an EnvStep"),
        ("no episode", "ConnectionError: game server refused the session"),
    ],
)
async def test_an_environment_that_fails_ends_the_sample_as_an_infrastructure_failure(
    tokenizer, failure: str, error: str
) -> None:  # type: ignore[no-untyped-def]
    task = Raising(failure=failure)
    before = TOOL_FAILURES.labels("env:raising", "RuntimeError")._value.get()
    _, rollout, s = make(tokenizer, task, ["<guess> 3 </guess>"], step_timeout_s=0.2)
    await rollout.run_sample(s)
    assert s.status == Status.ERROR
    assert s.infrastructure_failure
    assert error in s.error and error in s.turns[0].error
    assert task.closed == (0 if failure == "no episode" else 1)  # closed whatever happened
    if failure == "raise":  # counted by kind
        assert TOOL_FAILURES.labels("env:raising", "RuntimeError")._value.get() == before + 1


def test_the_rubric_replaces_reward_function_and_says_so() -> None:
    from orchestrator.config import RewardConfig

    Scorer(RewardConfig(), scored_by_task=True)
    with pytest.raises(HookError, match=r"leave reward\.function unset"):
        Scorer(RewardConfig(function="f1"), scored_by_task=True)


def test_guess_parsing_and_the_scripted_demonstration() -> None:
    assert parse_guess("<guess> 7 </guess>") == 7
    assert parse_guess("<guess>3</guess> then <guess> 9 </guess>") == 9
    assert parse_guess("seven") is None
    task = GuessNumberTask({"high": 16})
    for prompt in task.rows("eval")[:16]:
        moves = task.demonstration(prompt)
        assert parse_guess(moves[-1]) == int(prompt.golds[0])
        assert len(moves) <= task.par == 5


def test_splits_are_fixed_and_disjoint_by_id() -> None:
    a, b = GuessNumberTask({"seed": 3}), GuessNumberTask({"seed": 3})
    assert [p.golds for p in a.rows("train")] == [p.golds for p in b.rows("train")]
    train_ids = {p.prompt_id for p in a.rows("train")}
    assert not train_ids & {p.prompt_id for p in a.rows("eval")}


def test_built_in_tasks_load_by_name() -> None:
    task = load_task(TaskConfig(name="guess-number", options={"high": 8}))
    assert isinstance(task, GuessNumberTask) and task.high == 8
    assert set(BUILTIN_TASKS) >= {"search-r1", "guess-number", "reasoning-gym", "skyrl-gym"}


def test_a_task_in_a_file_outside_the_repository_loads_by_dotted_path(
    tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "my_env.py").write_text(
        textwrap.dedent(
            """
            from orchestrator.sample import Prompt
            from orchestrator.tasks import EnvStep, Episode, Task

            class Echo(Episode):
                async def step(self, action):
                    return EnvStep(reward=1.0, done=True)

            class EchoTask(Task):
                name = "echo"

                def rows(self, split):
                    hi = [{"role": "user", "content": "hi"}]
                    return [Prompt(f"echo/{split}/0", "echo", hi, ["hi"])]

                def episode(self, prompt):
                    return Echo()
            """
        )
    )
    # By the file's path: nothing on sys.path.
    task = load_task(TaskConfig(name=f"{tmp_path / 'my_env.py'}:EchoTask"))
    assert task.name == "echo" and task.rows("eval")[0].prompt_id == "echo/eval/0"
    with pytest.raises(HookError, match="no such file"):
        load_task(TaskConfig(name=f"{tmp_path / 'nope.py'}:EchoTask"))
    # By module name, with the file's folder on sys.path.
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_task(TaskConfig(name="my_env:EchoTask")).name == "echo"
    sys.modules.pop("my_env", None)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (TaskConfig(name="chess"), "neither a built-in task"),
        (TaskConfig(name="no_such_module:Task"), "cannot import module 'no_such_module'"),
        (TaskConfig(name="guess-number", options={"hihg": 3}), r"unknown options \['hihg'\]"),
        (TaskConfig(name="orchestrator.sample:Prompt"), "must accept 1 positional"),
        (TaskConfig(name="copy:copy"), "made dict, not an orchestrator.tasks.Task"),
    ],
)
def test_a_task_that_cannot_be_built_fails_naming_the_field(cfg: TaskConfig, message: str) -> None:
    with pytest.raises(HookError, match=message):
        load_task(cfg)


async def test_guesses_the_answers_still_allow_earn_the_consistency_bonus(tokenizer) -> None:  # type: ignore[no-untyped-def]
    task = secret_task(5, consistency_bonus=0.1)
    turns = [f"<guess> {n} </guess>" for n in (8, 12, 4, 5)]  # 12: "lower" than 8 excluded it
    _, rollout, s = make(tokenizer, task, turns, max_turns=6)
    await rollout.run_sample(s)
    assert [t.reward for t in s.turns] == [0.1, 0.0, 0.1, 1.0]
    assert s.reward == pytest.approx(1.2) and s.reward_components["em"] == 1.0


def test_eval_games_cover_every_secret_equally() -> None:
    """A policy's success is the share of secrets it finds: eval must not weigh some more."""
    rows = GuessNumberTask({"high": 16, "eval_size": 64, "seed": 5}).rows("eval")
    counts = collections.Counter(int(p.golds[0]) for p in rows)
    assert counts == {n: 4 for n in range(1, 17)}
    assert [p.golds for p in rows] != sorted(p.golds for p in rows)  # shuffled
