"""The reward registry, dotted-path hooks (contract tests) and group rewards."""

from __future__ import annotations

import pytest

from orchestrator.config import RewardConfig, RolloutConfig, SearchConfig
from orchestrator.hooks import HookError, load_hook
from orchestrator.rollout import Rollout
from orchestrator.sample import Prompt, Sample
from orchestrator.scoring import Scorer
from orchestrator.tools.search import SearchTool
from tests.unit.orchestrator.conftest import ScriptedEngine

H = "tests.unit.orchestrator.hook_examples"
GOOD = "<think>x</think><answer> Paris </answer>"
WRONG = "<think>x</think><answer> Rome </answer>"


def group(*responses: str) -> list[Sample]:
    p = Prompt("nq/train/1", "nq", [{"role": "user", "content": "q"}], ["Paris"])
    out = []
    for i, r in enumerate(responses):
        s = Sample(
            prompt=p, group_id="g", sample_index=i, group_size=len(responses), prompt_ids=[1]
        )
        s.response_text = r
        out.append(s)
    return out


@pytest.mark.parametrize(
    ("function", "expected"),
    [("em", [1.0, 0.0, 0.0]), ("sub_em", [1.0, 0.0, 0.0]), ("shaped", [1.0, 0.2, 0.1])],
)
async def test_builtins(function: str, expected: list[float]) -> None:
    g = group(GOOD, WRONG, "blah <answer> Rome </answer>")
    await Scorer(RewardConfig(function=function)).score_group(g)
    assert [s.reward for s in g] == pytest.approx(expected)
    assert g[0].reward_components["format"] == 1.0


async def test_weighted_combination() -> None:
    g = group(GOOD, "<answer> paris city </answer>")
    cfg = RewardConfig(function="weighted", weights={"em": 0.5, "f1": 0.3, "format": 0.2})
    await Scorer(cfg).score_group(g)
    # second: em 0, f1 = 2*(1/2*1)/(1/2+1) = 2/3, format 0 -> 0.3 * 2/3 = 0.2
    assert [s.reward for s in g] == pytest.approx([1.0, 0.2])


def test_weighted_unknown_component_fails_at_start() -> None:
    with pytest.raises(HookError, match="unknown components"):
        Scorer(RewardConfig(function="weighted", weights={"emm": 1.0}))


async def test_custom_sample_and_async_reward() -> None:
    g = group(GOOD)
    await Scorer(RewardConfig(function=f"{H}:length_reward")).score_group(g)
    assert g[0].reward == pytest.approx(len(GOOD) / 100)
    assert g[0].reward_components["em"] == 1.0  # components recorded regardless
    await Scorer(RewardConfig(function=f"{H}.async_reward")).score_group(g)
    assert g[0].reward == 0.5


async def test_group_reward_receives_whole_group() -> None:
    g = group(WRONG, GOOD, GOOD)
    await Scorer(RewardConfig(function=f"{H}:rank_in_group", group=True)).score_group(g)
    assert [s.reward for s in g] == [0.0, 1.0, 1.0]


async def test_group_reward_wrong_length_is_an_error() -> None:
    with pytest.raises(ValueError, match="one float per sample"):
        await Scorer(RewardConfig(function=f"{H}:bad_group", group=True)).score_group(
            group(GOOD, WRONG)
        )


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("nosuch", "neither a built-in"),
        ("nosuch.module:fn", "cannot import module"),
        (f"{H}:missing", "has no 'missing'"),
        (f"{H}:NOT_CALLABLE", "not callable"),
        (f"{H}:two_args", "must accept 1 positional"),
    ],
)
def test_bad_reward_hooks_fail_at_start(path: str, match: str) -> None:
    with pytest.raises(HookError, match=match):
        Scorer(RewardConfig(function=path))


def test_builtin_with_group_flag_rejected() -> None:
    with pytest.raises(HookError, match=r"reward\.group"):
        Scorer(RewardConfig(function="em", group=True))


def test_custom_generate_must_be_async_with_two_args(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, ["x"])
    tool = SearchTool(None, SearchConfig())  # type: ignore[arg-type]
    with pytest.raises(HookError, match="async def"):
        Rollout(RolloutConfig(custom_generate=f"{H}:sync_generate"), engine, tool, tokenizer)
    with pytest.raises(HookError, match="2 positional"):
        load_hook(f"{H}:length_reward", field="f", n_args=2)


async def test_custom_generate_runs(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, ["<answer> Paris </answer>"])
    tool = SearchTool(None, SearchConfig())  # type: ignore[arg-type]
    r = Rollout(RolloutConfig(custom_generate=f"{H}:answer_directly"), engine, tool, tokenizer)
    [s] = group("")
    s.response_text = ""
    await r.run_sample(s)
    assert s.response_text == "<answer> Paris </answer>" and s.status.value == "max_turns"
    assert s.loss_mask == [1] * len(s.response_ids)
