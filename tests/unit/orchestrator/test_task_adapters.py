"""The reasoning-gym and skyrl-gym adapters, against the real packages (no fakes of them):
rows, the packages' own scorers and turn rewards, rollouts with a scripted policy, token-exact
environment turns, and the errors of a bad configuration."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from skyrl_gym.envs.base_text_env import BaseTextEnv

from orchestrator.config import RolloutConfig, TaskConfig
from orchestrator.formats.environment import EnvTurns
from orchestrator.hooks import HookError
from orchestrator.rollout import Rollout
from orchestrator.sample import Sample, Status, new_group
from orchestrator.tasks.base import Task
from orchestrator.tasks.reasoning_gym import EVAL_SEED_OFFSET, ReasoningGymTask, exact
from orchestrator.tasks.registry import load_task
from orchestrator.tasks.skyrl_gym import SkyRLGymTask
from orchestrator.tokenizer import rust_tokenizer
from orchestrator.tools.toolbox import Toolbox
from tests.unit.orchestrator.conftest import ScriptedEngine


def make(tokenizer, task: Task, turns: list[str], index: int = 0, **cfg):  # type: ignore[no-untyped-def]
    """A rollout of `task`'s train row `index` with a scripted policy (as in test_tasks.py)."""
    engine = ScriptedEngine(tokenizer, turns)
    fast = rust_tokenizer(tokenizer)
    limits = TaskConfig(name=task.name, limits={"timeout_s": 5.0}).limits
    env = EnvTurns(task, fast, limits)
    rollout = Rollout(RolloutConfig(**cfg), engine, Toolbox([]), fast, env=env)
    prompt = task.rows("train")[index]
    ids = rollout.prompt_ids(prompt.messages)
    [s] = new_group(prompt, ids, group_size=1, rollout_step=0, run_id="r")
    return engine, rollout, s


def user_turn(tokenizer, content: str) -> str:  # type: ignore[no-untyped-def]
    """What the chat template puts after an assistant message and before the next one."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x00"}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*base, {"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    assert after.startswith(before)
    return before[before.index("\x00") + 1 :] + after[len(before) :]


# --- reasoning-gym ---------------------------------------------------------------------------


def rg(**options: Any) -> ReasoningGymTask:
    return ReasoningGymTask(
        {"dataset": "basic_arithmetic", "train_size": 8, "eval_size": 8, **options}
    )


def test_reasoning_gym_rows_are_fixed_by_the_seed_and_eval_is_not_train() -> None:
    a, b = rg(seed=3), rg(seed=3)
    train = a.rows("train")
    assert [(p.messages, p.golds) for p in train] == [
        (p.messages, p.golds) for p in b.rows("train")
    ]
    assert [p.golds for p in rg(seed=4).rows("train")] != [p.golds for p in train]
    p = train[0]
    assert p.prompt_id == "reasoning-gym/basic_arithmetic/train/0"
    assert p.data_source == "reasoning-gym/basic_arithmetic"
    assert p.metadata == {"split": "train", "index": "0"}
    assert p.messages[0]["content"].endswith("inside <answer> </answer>.")
    assert p.messages[0]["content"].startswith(a.entries("train")[0]["question"])
    assert p.golds == [str(a.entries("train")[0]["answer"])]
    # Items are Random(seed + index): eval is not train shifted by one (seed + 1 would be).
    evals = a.rows("eval")
    questions = {q.messages[0]["content"] for q in train}
    assert not questions & {q.messages[0]["content"] for q in evals}
    assert a._datasets["eval"].seed == 3 + EVAL_SEED_OFFSET
    assert not {q.prompt_id for q in train} & {q.prompt_id for q in evals}


def test_reasoning_gym_scores_with_the_dataset_s_own_scorer() -> None:
    task = ReasoningGymTask({"dataset": "leg_counting", "train_size": 2, "eval_size": 2})
    prompt = task.rows("eval")[1]
    gold = prompt.golds[0]

    def scored(text: str) -> dict[str, float]:
        sample = Sample(prompt, "g", 0, 1, [], response_text=text)
        return task.score(sample, task.episode(prompt))

    assert scored(task.demonstration(prompt)[0]) == {"reward": 1.0, "em": 1.0}
    assert scored(f"<answer> {int(gold) + 1} </answer>") == {"reward": 0.0, "em": 0.0}
    assert scored("no tags at all") == {"reward": 0.0, "em": 0.0}
    # The default scorer's partial credit: the gold inside a longer answer (docstring).
    partial = scored(f"<answer> {gold}0 </answer>")
    assert partial == {"reward": pytest.approx(len(gold) / (len(gold) + 1)), "em": 0.0}
    entry = task.entries("eval")[1]
    assert partial["reward"] == task._datasets["eval"].score_answer(f"{gold}0", entry)
    assert exact("-4", "4") == 0.0 and exact(" Yes ", "yes") == 1.0


async def test_reasoning_gym_rollout_earns_the_reward_for_the_gold_answer(tokenizer) -> None:  # type: ignore[no-untyped-def]
    task = load_task(TaskConfig(name="reasoning-gym", options={"dataset": "chain_sum"}))
    assert isinstance(task, ReasoningGymTask)
    gold = task.rows("train")[0].golds[0]
    engine, rollout, s = make(tokenizer, task, [f"<answer> {gold} </answer>"], max_turns=3)
    await rollout.run_sample(s)
    assert engine.calls[0]["stop"] == ["</answer>"]
    assert s.status == Status.ANSWERED and len(s.turns) == 1
    assert s.reward == 1.0 and s.reward_components == {"em": 1.0}
    assert s.loss_mask == [1] * len(s.response_ids)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dataset": "no_such_set"}, "no dataset 'no_such_set'"),
        ({}, "options.dataset"),
        ({"dataset": "chain_sum", "seed": None}, "options.seed"),
        ({"dataset": "chain_sum", "config": {"max_termz": 3}}, "options.config.*max_termz"),
        ({"dataset": "chain_sum", "config": {"seed": 3}}, r"options.config: set \['seed'\]"),
        ({"dataset": "chain_sum", "sead": 1}, r"unknown options \['sead'\]"),
    ],
)
def test_reasoning_gym_bad_options_name_the_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReasoningGymTask(options)


def test_reasoning_gym_config_reaches_the_dataset() -> None:
    task = ReasoningGymTask(
        {"dataset": "chain_sum", "train_size": 5, "config": {"min_terms": 2, "max_terms": 2}}
    )
    assert all(e["metadata"]["num_terms"] == 2 for e in task.entries("train"))


# --- skyrl-gym ---------------------------------------------------------------------------------

PROBLEMS = [
    ("Tom has 40 apples and buys 2 more. How many apples does he have?", "42"),
    ("A box holds 6 rows of 7 eggs. How many eggs are in the box?", "42"),
    ("Sara had 50 dollars and spent 8. How many dollars are left?", "42"),
]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def gsm8k_rows(tmp_path: Path) -> str:
    rows = [
        {
            "data_source": "gsm8k-mini",
            "prompt": [{"role": "user", "content": q + " Answer as '#### N'."}],
            "env_class": "gsm8k_multi_turn",
            "reward_spec": {"method": "rule", "ground_truth": gold},
            "extra_info": {"split": "train", "index": i},
        }
        for i, (q, gold) in enumerate(PROBLEMS)
    ]
    return write_rows(tmp_path / "train.jsonl", rows)


def skyrl_reference(actions: list[str], gold: str, max_turns: int) -> list[dict[str, Any]]:
    """skyrl-gym's own answers to `actions`, straight from the package."""
    import skyrl_gym

    env = skyrl_gym.make(
        "gsm8k_multi_turn",
        env_config={},
        extras={"reward_spec": {"ground_truth": gold}, "extra_info": {}, "max_turns": max_turns},
    )
    env.init([{"role": "user", "content": "q"}])
    return [env.step(a) for a in actions]


async def test_skyrl_multi_turn_feedback_is_appended_token_exactly(tokenizer, gsm8k_rows) -> None:  # type: ignore[no-untyped-def]
    task = SkyRLGymTask({"train_path": gsm8k_rows, "max_turns": 3})
    turns = ["I think it is #### 41", "Sorry: #### 42"]
    engine, rollout, s = make(tokenizer, task, turns, max_turns=5)
    await rollout.run_sample(s)
    assert s.status == Status.ANSWERED and len(s.turns) == 2
    ref = skyrl_reference(turns, "42", max_turns=3)
    feedback = ref[0]["observations"]
    assert [m["role"] for m in feedback] == ["user"] and ref[1]["done"]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
    obs = tokenizer.encode(user_turn(tokenizer, feedback[0]["content"]), add_special_tokens=False)
    assert s.response_ids == ids[0] + obs + ids[1]
    assert s.loss_mask == [1] * len(ids[0]) + [0] * len(obs) + [1] * len(ids[1])
    assert tokenizer.decode(s.response_ids) == s.response_text
    assert engine.calls[1]["input_ids"] == s.prompt_ids + ids[0] + obs
    assert engine.calls[0]["stop"] == []  # the end of the model's turn
    # Turn rewards as skyrl computes them: format credit 0.2 / max_turns, then full credit.
    assert [t.reward for t in s.turns] == [r["reward"] for r in ref] == [0.2 / 3, 1.0]
    assert s.reward == pytest.approx(1.0 + 0.2 / 3)
    assert s.reward_components == {"em": 1.0, "rewritten_actions": 0.0, "steps": 2.0}


async def test_skyrl_single_turn_gsm8k_and_a_wrong_answer(tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rows = [
        {"prompt": [{"role": "user", "content": q}], "reward_spec": {"ground_truth": g}}
        for q, g in PROBLEMS
    ]
    task = SkyRLGymTask({"env": "gsm8k", "train_path": write_rows(tmp_path / "t.jsonl", rows)})
    prompt = task.rows("train")[2]
    assert prompt.prompt_id == "skyrl-gym/gsm8k/train/2" and prompt.golds == ["42"]
    assert json.loads(prompt.metadata["extras"]) == {
        "reward_spec": {"ground_truth": "42"},
        "extra_info": {},
    }
    assert task.rows("eval") == []
    _, rollout, s = make(tokenizer, task, task.demonstration(prompt), index=2, max_turns=4)
    await rollout.run_sample(s)
    assert s.status == Status.ANSWERED and len(s.turns) == 1
    assert (s.reward, s.reward_components["em"]) == (1.0, 1.0)
    # gsm8k is one answer: a wrong one ends the episode with nothing, as skyrl scores it.
    _, rollout, s = make(tokenizer, task, ["#### 7"], max_turns=4)
    await rollout.run_sample(s)
    assert s.status == Status.ANSWERED and len(s.turns) == 1
    assert (s.reward, s.reward_components["em"]) == (0.0, 0.0)


async def test_skyrl_env_that_cannot_be_made_fails_the_sample_not_the_rollout(
    tokenizer, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    rows = [{"prompt": [{"role": "user", "content": "q"}], "env_class": "gsm8k"}]  # no truth
    task = SkyRLGymTask({"train_path": write_rows(tmp_path / "t.jsonl", rows)})
    _, rollout, s = make(tokenizer, task, ["#### 1"])
    await rollout.run_sample(s)
    assert s.status == Status.ERROR and s.infrastructure_failure
    assert "reward_spec" in s.error


class Rewriting(BaseTextEnv):
    """A user's skyrl env (registered with skyrl_gym.register) that rewrites the action, or,
    with extra_info.rewrite_prompt, the prompt in init()."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.extras = extras or {}

    def init(self, prompt):  # type: ignore[no-untyped-def]
        if self.extras["extra_info"].get("rewrite_prompt"):
            return [{"role": "system", "content": "be brief"}, *prompt], {}
        return prompt, {}

    def step(self, action):  # type: ignore[no-untyped-def]
        self.turns += 1
        return {
            "observations": [{"role": "user", "content": "again"}],
            "reward": 0.5,
            "done": self.turns >= 2,
            "metadata": {"cut": True, "note": "text is dropped"},
            "postprocessed_action": action.split("</answer>")[0] + "</answer>",
        }


@pytest.fixture
def rewriting_env():  # type: ignore[no-untyped-def]
    import skyrl_gym
    from skyrl_gym.envs.registration import registry

    skyrl_gym.register(id="searchr1_test_rewriting", entry_point=Rewriting)
    yield "searchr1_test_rewriting"
    registry.pop("searchr1_test_rewriting", None)


async def test_skyrl_rewritten_actions_are_counted_never_trained_on(
    tokenizer, tmp_path, rewriting_env
) -> None:  # type: ignore[no-untyped-def]
    rows = [
        {"prompt": [{"role": "user", "content": "q"}]},
        {"prompt": [{"role": "user", "content": "q"}], "extra_info": {"rewrite_prompt": 1}},
    ]
    task = SkyRLGymTask({"env": rewriting_env, "train_path": write_rows(tmp_path / "t", rows)})
    turns = ["<answer> 1 </answer> and more", "<answer> 2 </answer>"]
    _, rollout, s = make(tokenizer, task, turns, max_turns=4)
    await rollout.run_sample(s)
    assert s.status == Status.ANSWERED and len(s.turns) == 2
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
    assert s.response_ids[: len(ids[0])] == ids[0]  # the model's ids, not the env's cut text
    assert s.reward == 1.0
    assert s.reward_components == {"em": 0.0, "rewritten_actions": 1.0}
    # An env whose init() changes the prompt the model already read fails that sample.
    _, rollout, s = make(tokenizer, task, turns, index=1, max_turns=4)
    await rollout.run_sample(s)
    assert s.status == Status.ERROR and "rewrote the prompt in init()" in s.error


def test_skyrl_loads_by_name_and_bad_options_name_the_option(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = write_rows(tmp_path / "t.jsonl", [{"prompt": [{"role": "user", "content": "q"}]}])
    task = load_task(TaskConfig(name="skyrl-gym", options={"env": "gsm8k", "train_path": path}))
    assert isinstance(task, SkyRLGymTask)
    with pytest.raises(HookError, match=r"options.env: skyrl-gym has no environment 'gsm9k'"):
        load_task(TaskConfig(name="skyrl-gym", options={"env": "gsm9k", "train_path": path}))
    with pytest.raises(ValueError, match=r"unknown options \['max_turn'\]"):
        SkyRLGymTask({"env": "gsm8k", "train_path": path, "max_turn": 3})
    with pytest.raises(ValueError, match=r"options\.train_path"):
        SkyRLGymTask({"env": "gsm8k"})
    with pytest.raises(ValueError, match=r"row 0: no env_class, and options\.env is unset"):
        SkyRLGymTask({"train_path": path}).rows("train")
    bad = write_rows(tmp_path / "b.jsonl", [{"prompt": "q", "env_class": "gsm8k"}])
    with pytest.raises(ValueError, match="row 0: prompt must be a list of messages"):
        SkyRLGymTask({"train_path": bad}).rows("train")


@pytest.mark.parametrize(
    ("cls", "module", "options"),
    [
        (ReasoningGymTask, "reasoning_gym", {"dataset": "chain_sum"}),
        (SkyRLGymTask, "skyrl_gym", {"env": "gsm8k", "train_path": "x"}),
    ],
)
def test_a_missing_package_says_which_and_how_to_install(
    monkeypatch, cls: type[Task], module: str, options: dict[str, Any]
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    package = module.replace("_", "-")
    with pytest.raises(ValueError, match=rf"task {package} needs the package {package} \(pip"):
        cls(options)
