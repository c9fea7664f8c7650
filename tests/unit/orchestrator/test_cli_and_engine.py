"""CLI errors name the field; a restarting engine is waited for; metric summaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from engine_client.client import InferenceBadRequest, InferenceUnavailable
from orchestrator.config import RolloutConfig, SearchConfig
from orchestrator.metrics import step_summary
from orchestrator.prompt import prompt_token_ids
from orchestrator.rollout import Rollout
from orchestrator.sample import Status, new_group
from orchestrator.tools.search import SearchTool
from stack.cli import app
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_rollout import PROMPT, TURN1, TURN2, FakeRetriever


class FlakyEngine(ScriptedEngine):
    failures: int = 0
    exc: Exception | None = None

    async def generate(self, input_ids, **kw):  # type: ignore[no-untyped-def]
        if self.failures > 0:
            self.failures -= 1
            raise self.exc or InferenceUnavailable("/generate: HTTP 503")
        return await super().generate(input_ids, **kw)


def one_sample(tokenizer, engine, retry_s: float = 30.0):  # type: ignore[no-untyped-def]
    tool = SearchTool(FakeRetriever(), SearchConfig())
    rollout = Rollout(RolloutConfig(), engine, tool, tokenizer, engine_retry_s=retry_s)
    ids = prompt_token_ids(tokenizer, PROMPT.messages)
    [s] = new_group(PROMPT, ids, group_size=1, rollout_step=0, run_id="r")
    return rollout, s


async def test_engine_restart_is_waited_for(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = FlakyEngine(tokenizer, [TURN1, TURN2])
    engine.failures = 2
    rollout, s = one_sample(tokenizer, engine)
    await rollout.run_sample(s)
    assert s.status == Status.ANSWERED and engine.failures == 0


async def test_engine_down_for_too_long_is_an_error(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = FlakyEngine(tokenizer, [TURN1, TURN2])
    engine.failures = 100
    rollout, s = one_sample(tokenizer, engine, retry_s=0.6)
    await rollout.run_sample(s)
    assert s.status == Status.ERROR and "engine unavailable" in s.error


async def test_engine_bad_request_is_an_error_not_a_crash(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = FlakyEngine(tokenizer, [TURN1, TURN2])
    engine.failures, engine.exc = 1, InferenceBadRequest("/generate: HTTP 400: too long")
    rollout, s = one_sample(tokenizer, engine)
    await rollout.run_sample(s)
    assert s.status == Status.ERROR and "too long" in s.error


async def test_step_summary(tokenizer) -> None:  # type: ignore[no-untyped-def]
    rollout, s = one_sample(tokenizer, ScriptedEngine(tokenizer, [TURN1, TURN2]))
    await rollout.run_sample(s)
    s.reward, s.reward_components = 1.0, {"em": 1.0}
    summary = step_summary([s], 2.0)
    obs = len(s.loss_mask) - sum(s.loss_mask)
    assert summary["observation_fraction"] == pytest.approx(obs / len(s.loss_mask))
    assert summary["searches_mean"] == 1.0 and summary["turns_mean"] == 2.0
    assert summary["samples_per_s"] == 0.5 and summary["invalid_action_rate"] == 0.0


def test_run_rejects_bad_reward_hook_naming_the_field(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    row = {
        "prompt": [{"role": "user", "content": "q"}],
        "reward_model": {"ground_truth": {"target": ["a"]}},
    }
    rows.write_text(json.dumps(row) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "redis": {"url": "redis://127.0.0.1:1/0"},
                "orchestrator": {
                    "data": {"train_path": str(rows)},
                    "reward": {"function": "no.such:fn"},
                },
            }
        )
    )
    result = CliRunner().invoke(app, ["orchestrator", "run", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "reward.function" in result.output and "no.such" in result.output


def test_run_requires_data(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"redis": {"url": "redis://127.0.0.1:1/0"}}))
    result = CliRunner().invoke(app, ["orchestrator", "run", "--config", str(cfg)])
    assert result.exit_code == 2 and "data.train_path" in result.output


def test_bad_config_field_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"orchestrator": {"rollout": {"max_turns": 0}}}))
    result = CliRunner().invoke(app, ["orchestrator", "show-config", "--config", str(cfg)])
    assert result.exit_code == 2 and "orchestrator.rollout.max_turns" in result.output


def test_data_prepare_command(tmp_path: Path) -> None:
    (tmp_path / "nq").mkdir()
    (tmp_path / "nq" / "train.jsonl").write_text(
        json.dumps({"id": "0", "question": "who", "golden_answers": ["x"]}) + "\n"
    )
    out = tmp_path / "train.parquet"
    args = ["data", "prepare", "--input", str(tmp_path), "--datasets", "nq", "--split", "train"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "wrote 1 rows" in result.output
    from orchestrator.data import load_prompts

    [p] = load_prompts(out)
    assert p.prompt_id == "nq/train/0" and p.messages[0]["content"].endswith("Question: who?\n")
    bad = CliRunner().invoke(
        app, ["data", "prepare", "--input", str(tmp_path), "--datasets", "popqa", "--out", str(out)]
    )
    assert bad.exit_code == 2 and "popqa" in bad.output


class AbortingEngine(ScriptedEngine):
    """Aborts its first `aborts` calls (a weight update with pause_generation(abort))."""

    aborts: int = 0

    async def generate(self, input_ids, **kw):  # type: ignore[no-untyped-def]
        r = await super().generate(input_ids, **kw)
        if self.aborts > 0:
            self.aborts -= 1
            self.weight_version += 1
            r.finish_reason, r.output_ids, r.logprobs = "abort", r.output_ids[:2], r.logprobs[:2]
        return r


async def test_aborted_turn_is_regenerated_not_stitched(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = AbortingEngine(tokenizer, [TURN1, TURN2])
    engine.aborts = 2
    rollout, s = one_sample(tokenizer, engine)
    await rollout.run_sample(s)
    assert s.status == Status.ANSWERED
    t1 = tokenizer.encode(TURN1, add_special_tokens=False)
    assert s.response_ids[: len(t1)] == t1  # the partial output of the aborted calls is gone
    assert [t.weight_version for t in s.turns] == [2, 2]


async def test_abort_retries_are_bounded(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = AbortingEngine(tokenizer, [TURN1, TURN2])
    engine.aborts = 100
    tool = SearchTool(FakeRetriever(), SearchConfig())
    rollout = Rollout(RolloutConfig(max_abort_retries=1), engine, tool, tokenizer)
    ids = prompt_token_ids(tokenizer, PROMPT.messages)
    [s] = new_group(PROMPT, ids, group_size=1, rollout_step=0, run_id="r")
    await rollout.run_sample(s)
    assert s.status == Status.ABORTED and len(engine.calls) == 2


def test_run_rejects_data_too_short_for_the_trainers_steps(tmp_path: Path) -> None:
    """10 prompts / 4 per step = 2 steps, but the run wants 3: the trainer would wait forever."""
    rows = tmp_path / "rows.jsonl"
    row = {
        "prompt": [{"role": "user", "content": "q"}],
        "reward_model": {"ground_truth": {"target": ["a"]}},
    }
    rows.write_text((json.dumps(row) + "\n") * 10)
    stack = {
        "redis": {"url": "redis://127.0.0.1:1/0"},
        "run": {"groups_per_step": 4, "max_steps": 3},
        "orchestrator": {"data": {"train_path": str(rows)}},
    }
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(stack))
    result = CliRunner().invoke(app, ["orchestrator", "run", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "run.max_steps is 3" in result.output and "orchestrator.epochs" in result.output

    from orchestrator.cli import check_enough_data
    from orchestrator.config import OrchestratorSettings
    from orchestrator.data import load_prompts

    prompts = load_prompts(rows)
    cfg = OrchestratorSettings.model_validate({**stack, "redis": {}})
    check_enough_data(cfg, prompts + prompts[:2])  # 12 prompts: 3 steps, enough
    stack["orchestrator"]["epochs"] = 2  # type: ignore[index]
    check_enough_data(OrchestratorSettings.model_validate({**stack, "redis": {}}), prompts)
