"""`searchr1 demo --task NAME` for a task whose environment answers every turn (guess-number).

The same stages as the Search-R1 demo, with the task in place of the world and the retriever:
1. the task's rows (train and eval) and its scripted demonstrations, played through the real
   rollout loop (its environment, its rubric), give the warm start's token ids and loss masks;
2. a tiny model + tokenizer trained on the task's text, warm-started on a few of those;
3. held-out evaluation (greedy, the task's eval rows) through the real engine;
4. GRPO through `searchr1 local` (Redis, engine, orchestrator stepping the task's episodes,
   trainer; no retriever);
5. held-out evaluation of the trained policy; success ("em", the rubric's) before and after.

The warm start teaches the format and the strategies the task demonstrates (guess-number:
binary search in 3 games of 10, a scan in 7, so that it prefers the worse one); RL, paid by
the rubric for the win, has to choose and sharpen.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from demos.run import DemoConfig, build_policy_from, evaluate, plot, write_stack_config
from demos.warmstart import Demo, Phase, WarmStartConfig
from engine_client.client import GenerateResult
from inference.tiny_model import default_corpus
from orchestrator.config import RolloutConfig, TaskConfig
from orchestrator.formats.environment import EnvTurns
from orchestrator.rollout import Rollout
from orchestrator.sample import Prompt, new_group
from orchestrator.tasks.base import Task
from orchestrator.tasks.registry import load_task
from orchestrator.tokenizer import rust_tokenizer
from orchestrator.tools.toolbox import Toolbox
from stack.config import load_config
from stack.launcher import run_local
from stack.task_cli import scripted_rollout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskDemo:
    """A task's demo settings: its options and the rollout limits its episodes need."""

    options: dict[str, Any]
    rollout: dict[str, Any]
    rl_steps: int
    warm_start: WarmStartConfig
    trainer: dict[str, Any]  # over the demo template's trainer section (e.g. the lr)
    demonstrations: int = 64  # train rows whose scripted demonstrations the warm start sees


TASK_DEMOS: dict[str, TaskDemo] = {
    # 16 numbers, 4 guesses: binary search wins 15 in 16 games, a scan (1, 2, 3, 4) 4 in 16.
    # The warm start sees both, 3 games of binary search to 7 of scans, cut at the game's 4
    # guesses: it knows both strategies and prefers the scan (greedy 0.25); the first guess
    # (8 or 1) picks the strategy, and GRPO's signal for it is strong (a game's outcome
    # hangs on it). Runs 1-10 (docs/benchmarks.md) warm-started on one strategy, binary search
    # or random guesses, and left RL the midpoint of each interval to find: not learned.
    "guess-number": TaskDemo(
        options={
            "high": 16,
            "train_size": 512,
            "eval_size": 64,
            "demonstration": {"binary-search": 0.3, "scan": 0.7},
        },
        rollout={
            "max_turns": 4,
            "max_tokens_per_turn": 12,
            "max_response_tokens": 192,
            "temperature": 1.0,
        },
        rl_steps=30,
        warm_start=WarmStartConfig(copy_steps=0, format_steps=150, mix_steps=0, batch_size=16),
        trainer={"optim": {"lr": 5e-4}},
        demonstrations=256,
    ),
}


def demo_task(name: str, seed: int) -> tuple[Task, TaskDemo]:
    if name not in TASK_DEMOS:
        raise ValueError(f"no demo for task {name!r} (demos: {', '.join(TASK_DEMOS)})")
    spec = TASK_DEMOS[name]
    options = {**spec.options, "seed": seed}
    return load_task(TaskConfig(name=name, options=options)), replace(spec, options=options)


async def demonstrations(
    task: Task, tokenizer: Any, prompts: list[Prompt], max_turns: int = 16
) -> list[Demo]:
    """Each prompt's scripted demonstration through the real loop, its first `max_turns`
    turns: its ids and loss masks."""
    out = []
    for p in prompts:
        rollout = scripted_rollout(task, tokenizer, task.demonstration(p), max_turns=max_turns)
        [s] = new_group(p, rollout.prompt_ids(p.messages), group_size=1, rollout_step=0, run_id="d")
        await rollout.run_sample(s)
        out.append(Demo(s.prompt_ids, s.response_ids, s.loss_mask, False, p.golds[0]))
    return out


class TaskSampler:
    """`sft`'s sampler over a fixed set of demonstrations."""

    def __init__(self, demos: list[Demo]) -> None:
        self.demos = demos

    def batches(self, phase: Phase, rng: random.Random) -> Iterator[list[Demo]]:
        for _ in range(phase.steps):
            yield rng.sample(self.demos, min(phase.batch_size, len(self.demos)))


def task_texts(task: Task) -> list[str]:
    """What the tokenizer is trained on besides its base corpus: the rows and the demos."""
    prompts = task.rows("train")[:64]
    texts = [m["content"] for p in prompts for m in p.messages]
    texts += [" ".join(task.demonstration(p)) for p in prompts]
    return texts * 10


def stack_settings(task: Task, spec: TaskDemo) -> Any:
    """The stack config's edits for the task: no retriever, the task, its rollout limits."""

    def edit(data: dict[str, Any]) -> None:
        data["local"]["services"] = ["inference", "orchestrator", "trainer"]
        orch = data["orchestrator"]
        orch["task"] = {"name": task.name, "options": spec.options}
        orch["data"].pop("train_path", None)
        orch["rollout"].update(spec.rollout)
        orch["rollout"].pop("stop", None)
        orch["reward"].pop("function", None)
        for section, values in spec.trainer.items():
            data["trainer"].setdefault(section, {}).update(values)

    return edit


def run_task_demo(cfg: DemoConfig) -> dict[str, float]:
    """`cfg`: the demo's settings, `cfg.task` naming a task of TASK_DEMOS."""
    start = time.monotonic()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    task, spec = demo_task(cfg.task, cfg.seed)
    warm_cfg = replace(spec.warm_start, seed=cfg.seed)
    if cfg.quick:
        warm_cfg = replace(warm_cfg, format_steps=5)
    cfg = replace(cfg, warm_start=warm_cfg)

    def sampler(tok: Any) -> TaskSampler:
        prompts = task.rows("train")[: spec.demonstrations]
        # the games as RL plays them: cut at its turn limit
        turns = int(spec.rollout["max_turns"])
        return TaskSampler(asyncio.run(demonstrations(task, rust_tokenizer(tok), prompts, turns)))

    if cfg.warm_start_from is None:
        warm = build_policy_from(cfg, default_corpus(0) + task_texts(task), 2048, sampler)
    else:
        warm = cfg.warm_start_from / "model-warm"
    n_train = len(task.rows("train"))
    stack = write_stack_config(cfg, None, warm, n_train, stack_settings(task, spec))
    before = evaluate(stack, warm, None, cfg.out_dir / "eval_before.json", cfg.eval_limit)
    run_local(load_config(stack), stack, max_steps=cfg.rl_steps)
    trained = cfg.out_dir / "model-trained"
    after = evaluate(stack, trained, None, cfg.out_dir / "eval_after.json", cfg.eval_limit)
    b, a = before["overall"], after["overall"]
    plot(cfg.out_dir / "train_metrics.jsonl", b["em"], a["em"], cfg.out_dir / "demo.png")
    turns = {k: float(r.get("turns_mean", math.nan)) for k, r in (("b", b), ("a", a))}
    return {
        "em_before": float(b["em"]),
        "em_after": float(a["em"]),
        "reward_before": float(b["reward"]),
        "reward_after": float(a["reward"]),
        "turns_per_episode_before": turns["b"],
        "turns_per_episode_after": turns["a"],
        "wall_s": time.monotonic() - start,
    }


class SampledPolicy:
    """Stands in for the engine (one process, no services): samples a saved model's next turn
    at `temperature` until a stop string, for the sampled held-out success of `bench/`."""

    def __init__(self, model_dir: Path, temperature: float, seed: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.temperature = temperature
        self.gen = torch.Generator().manual_seed(seed)

    async def generate(self, input_ids: list[int], **kw: Any) -> GenerateResult:
        import torch

        out: list[int] = []
        text = ""
        with torch.no_grad():  # no KV cache: a few hundred tokens of a tiny model
            for _ in range(kw["max_new_tokens"]):
                logits = self.model(input_ids=torch.tensor([input_ids + out])).logits[0, -1]
                probs = torch.softmax(logits / self.temperature, -1)
                out.append(int(torch.multinomial(probs, 1, generator=self.gen)))
                text = self.tok.decode(out)
                if out[-1] == self.tok.eos_token_id or any(s in text for s in kw["stop"]):
                    break
        return GenerateResult(
            text=text,
            output_ids=out,
            logprobs=[0.0] * len(out),
            finish_reason="stop",
            matched_stop=None,
            prompt_tokens=len(input_ids),
            completion_tokens=len(out),
            weight_version=0,
            start_weight_version=0,
        )


def sampled_success(
    task_name: str, seed: int, model_dir: Path, attempts: int, limit: int | None = None
) -> float:
    """The share of `attempts` sampled games per eval row (the first `limit`) that `model_dir`
    wins, at the demo's training temperature, through the real loop (the task's environment
    and rubric)."""
    task, spec = demo_task(task_name, seed)
    cfg = RolloutConfig(**{k: v for k, v in spec.rollout.items() if k != "temperature"})
    policy = SampledPolicy(model_dir, float(spec.rollout["temperature"]), seed)
    tokenizer = rust_tokenizer(policy.tok)

    async def play(prompt: Prompt) -> float:
        env = EnvTurns(task, tokenizer, TaskConfig(name=task.name).limits)
        rollout = Rollout(cfg, policy, Toolbox([]), tokenizer, env=env)
        ids = rollout.prompt_ids(prompt.messages)
        [s] = new_group(prompt, ids, group_size=1, rollout_step=0, run_id="sampled")
        await rollout.run_sample(s)
        return float(s.reward_components.get("em", 0.0))

    wins = [asyncio.run(play(p)) for p in task.rows("eval")[:limit] for _ in range(attempts)]
    return sum(wins) / len(wins)
