"""`searchr1 demo --task guess-number`'s stages without the services: the warm start's
demonstrations come out of the real loop token-exact, and the stack config it writes loads."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from demos.run import DemoConfig, write_stack_config
from demos.task import (
    TaskSampler,
    demo_task,
    demonstrations,
    sampled_success,
    stack_settings,
)
from demos.warmstart import Phase
from orchestrator.tokenizer import rust_tokenizer
from stack.config import load_config


def test_demonstrations_are_the_loops_ids_with_the_models_tokens_masked_in(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task, _ = demo_task("guess-number", seed=0)
    prompts = task.rows("train")[:4]
    demos = asyncio.run(demonstrations(task, rust_tokenizer(tokenizer), prompts))
    for p, d in zip(prompts, demos, strict=True):
        model = [t for t, m in zip(d.response_ids, d.loss_mask, strict=True) if m]
        assert tokenizer.decode(model) == "".join(task.demonstration(p))
        text = tokenizer.decode(d.response_ids)
        assert text.count("higher") + text.count("lower") == len(task.demonstration(p)) - 1
    batches = list(TaskSampler(demos).batches(Phase("f", 3, 2, 1e-3, 1.0, False), random.Random(0)))
    assert len(batches) == 3 and all(len(b) == 2 for b in batches)


def test_the_stack_config_has_the_task_and_no_retriever(tmp_path: Path) -> None:
    task, spec = demo_task("guess-number", seed=3)
    cfg = DemoConfig(out_dir=tmp_path, task="guess-number", rl_steps=30)
    path = write_stack_config(cfg, None, tmp_path / "model", 512, stack_settings(task, spec))
    stack = load_config(path)
    assert stack.local.services == ["inference", "orchestrator", "trainer"]
    assert stack.orchestrator.task is not None
    assert stack.orchestrator.task.name == "guess-number"
    assert stack.orchestrator.task.options["seed"] == 3
    assert stack.orchestrator.data.train_path is None
    assert stack.orchestrator.rollout.max_turns == spec.rollout["max_turns"]
    assert stack.trainer.optim.lr == spec.trainer["optim"]["lr"]
    # enough passes over the 512 rows for 30 steps of 16 groups
    assert stack.orchestrator.epochs * 512 >= 30 * stack.run.groups_per_step


def test_sampled_success_plays_the_eval_games_through_the_loop(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    # An untrained model rarely writes a guess; what matters: games played, a share returned.
    share = sampled_success("guess-number", 0, tiny_model_dir, attempts=2, limit=2)
    assert share in (0.0, 0.25, 0.5, 0.75, 1.0)


def test_the_warm_start_sees_both_strategies_cut_at_the_games_turns(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from orchestrator.tasks.guess_number import parse_guess

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task, spec = demo_task("guess-number", seed=0)
    turns = spec.rollout["max_turns"]
    prompts = task.rows("train")[:24]
    demos = asyncio.run(demonstrations(task, rust_tokenizer(tokenizer), prompts, turns))
    firsts = set()
    for p, d in zip(prompts, demos, strict=True):
        model = [t for t, m in zip(d.response_ids, d.loss_mask, strict=True) if m]
        # exactly the demonstration's first `turns` guesses, nothing after
        assert tokenizer.decode(model) == "".join(task.demonstration(p)[:turns])
        firsts.add(parse_guess(task.demonstration(p)[0]))
    assert firsts == {1, 8}  # scans and binary searches
