"""`searchr1 demo`: offline, deterministic given a seed; the README's main command.

1. a synthetic world (`world.py`) -> corpus + train/test questions;
2. a dense MiniLM index (`retriever.build`);
3. a tiny model + tokenizer, then a supervised warm start (`warmstart.py`);
4. held-out evaluation of the warm-started policy (`searchr1 eval`, greedy) through the real
   retriever and inference services;
5. GRPO through the real stack (`searchr1 local`: Redis, retriever, engine, orchestrator,
   trainer; weights pushed to the engine over gloo);
6. held-out evaluation of the trained policy, a before/after table, a PNG plot, and a last
   line of key=value pairs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from demos import multitool as mt
from demos.multitool import TASK as TASK_MULTI_TOOL
from demos.multitool import YearsWorld
from demos.warmstart import DemoSampler, WarmStartConfig, sft
from demos.world import World, generate_world, write_jsonl, write_world
from inference.sglang_launcher import cpu_settings
from inference.tiny_model import default_corpus, make_tiny_model
from orchestrator.data import load_prompts
from orchestrator.prompt import make_row
from orchestrator.tasks.registry import load_task
from orchestrator.wiring import evaluate_served
from retriever.build import build_index
from retriever.config import BuildConfig
from searchr1.redis_server import free_port
from searchr1.supervisor import Supervisor
from stack.config import load_config
from stack.launcher import build_specs, run_local

log = logging.getLogger(__name__)

CONFIG_TEMPLATE = Path(__file__).resolve().parents[1] / "configs" / "demo-cpu.yaml"
TASK_SEARCH_R1 = "search-r1"
TASKS = (TASK_SEARCH_R1, TASK_MULTI_TOOL)
# GRPO steps by task when `--steps` is not given
RL_STEPS = {TASK_SEARCH_R1: 30, TASK_MULTI_TOOL: mt.RL_STEPS}


@dataclass(frozen=True)
class DemoConfig:
    out_dir: Path = Path("runs/demo")
    seed: int = 0
    n_people: int = 400
    hidden_size: int = 128
    num_layers: int = 2
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    rl_steps: int = RL_STEPS[TASK_SEARCH_R1]
    eval_limit: int | None = None
    quick: bool = False
    # The warm start runs alone (no services yet), so by default it uses every core.
    warm_start_threads: int | None = None
    engine: str = "torch"  # the inference service: our reference engine, or "sglang"
    sglang_python: str | None = None  # SGLang's interpreter (`python3 dev.py sglang` makes one)
    trainer_backend: str = "hf"  # `trainer.backend`: hf (HF model) or megatron (Megatron-Core)
    engines: int = 1  # inference processes; the orchestrator routes over them (EnginePool)
    train_seed: int | None = None  # data order and trainer seed on the same world (None: seed)
    # DAPO's dynamic sampling: over_sampling = groups_per_step // 4, group_filter reward_std.
    dynamic_sampling: bool = False
    # A finished demo's out dir with the same seed: its warm-started model is reused (the warm
    # start is deterministic per seed; 2.7 of the demo's 8 minutes), e.g. over training seeds.
    warm_start_from: Path | None = None
    # "search-r1" (Search-R1's tags, one tool) or "multi-tool" (search + an MCP calculator in
    # the function-calling format: demos/multitool.py)
    task: str = "search-r1"
    # "disaggregated" (weights broadcast over gloo) or "colocated": the engines release their
    # memory while the trainer trains and take its weights from shared memory (docs/deploy.md)
    placement: str = "disaggregated"

    @classmethod
    def quick_mode(cls, out_dir: Path, seed: int = 0, **chosen: Any) -> DemoConfig:
        """A few steps of everything: exercises the whole path in minutes (the test suite).
        `chosen`: the engine and trainer backend fields."""
        return cls(
            **chosen,
            out_dir=out_dir,
            seed=seed,
            n_people=60,
            warm_start=WarmStartConfig(
                copy_steps=10,
                copy_batch_size=8,
                format_steps=5,
                mix_steps=5,
                batch_size=8,
                seed=seed,
            ),
            rl_steps=2,
            eval_limit=8,
            quick=True,
            warm_start_threads=1,
        )


def _world_texts(world: World | YearsWorld) -> list[str]:
    return [r["contents"] for r in world.corpus_rows()] + [q.question for q in world.questions]


def write_rows(world: World, out: Path) -> dict[str, Path]:
    paths = {}
    for split in ("train", "test"):
        rows = (
            make_row(q.question, q.answers, data_source=q.data_source, split=split, index=i)
            for i, q in enumerate(world.split(split))
        )
        paths[split] = write_jsonl(out / f"{split}.jsonl", rows)
    return paths


def tokenizer_corpus(
    world: World | YearsWorld, extra: Sequence[str] = (), extra_vocab: int = 0
) -> tuple[list[str], int]:
    """(training text, vocabulary size) with which BPE makes every made-up name one token.
    `extra`: more text (a task's tool calls), needing `extra_vocab` more entries."""
    names = world.entity_names()
    texts = default_corpus(0) + _world_texts(world) + [" " + " ".join(names)] * 30 + list(extra)
    # the base vocabulary + each name with the merges that build it
    return texts, 2048 + 4 * len(names) + extra_vocab


def build_policy(
    cfg: DemoConfig,
    world: World | YearsWorld,
    make_sampler: Callable[[Any], Any] | None = None,
    extra_texts: Sequence[str] = (),
    extra_vocab: int = 0,
) -> Path:
    """The tiny model, warm-started on demonstrations; returns its HF directory.
    `make_sampler(tokenizer)`: the task's demonstrations (default: Search-R1's `DemoSampler`)."""
    texts, vocab_size = tokenizer_corpus(world, extra_texts, extra_vocab)
    if make_sampler is None:
        assert isinstance(world, World)
        search_r1 = world

        def make_sampler(tok: Any) -> Any:
            return DemoSampler(search_r1, tok, cfg.warm_start)

    return build_policy_from(cfg, texts, vocab_size, make_sampler)


def build_policy_from(
    cfg: DemoConfig, texts: Sequence[str], vocab_size: int, make_sampler: Callable[[Any], Any]
) -> Path:
    """The tiny model with a tokenizer trained on `texts`, warm-started on the demonstrations
    of `make_sampler(tokenizer)`; returns its HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = make_tiny_model(
        cfg.out_dir / "model-base",
        seed=cfg.seed,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        vocab_corpus=texts,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
    )
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.warm_start_threads or os.cpu_count() or 1)
    try:
        losses = sft(model, make_sampler(tok), cfg.warm_start)
    finally:
        torch.set_num_threads(threads)
    warm = cfg.out_dir / "model-warm"
    model.save_pretrained(warm)
    tok.save_pretrained(warm)
    log.info("warm start done", extra={"final_loss": round(losses[-1], 4)})
    return warm


def free_port_run(n: int) -> int:
    """The first of `n` consecutive free loopback ports."""
    for _ in range(100):
        first = free_port()
        try:
            with contextlib.ExitStack() as held:
                for port in range(first, first + n):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


def write_stack_config(
    cfg: DemoConfig,
    index_dir: Path | None,
    model_dir: Path,
    rows: dict | int,
    task_settings: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """The demo's stack config: the shipped template with this run's paths filled in, and the
    task's settings (`task_settings` edits the loaded YAML) over it. `rows`: the data files
    ({"train": path}), or the number of train rows of a task that brings its own (then there
    is no `index_dir` either: no retriever)."""
    data = yaml.safe_load(CONFIG_TEMPLATE.read_text())
    if task_settings is not None:
        task_settings(data)
    out = cfg.out_dir.resolve()
    if index_dir is not None:
        data["retriever"]["index_dir"] = str(index_dir.resolve())
    data["inference"]["model_path"] = str(model_dir.resolve())
    data["run"]["max_steps"] = cfg.rl_steps
    # As many passes over the training questions as the RL steps need (else the trainer would
    # wait for steps the data cannot give: the orchestrator refuses to start).
    if isinstance(rows, int):
        n_train = rows
    else:
        data["orchestrator"]["data"]["train_path"] = str(rows["train"].resolve())
        n_train = len(rows["train"].read_text().splitlines())
    per_step = data["run"]["groups_per_step"]
    if cfg.dynamic_sampling:
        over = max(1, per_step // 4)
        data["orchestrator"]["rollout"].update(over_sampling=over, group_filter="reward_std")
        # Filtered steps are completed by later ones: as the policy masters the world, most
        # groups score all-correct and are dropped, so the run may take several times the
        # steps; data for 4x (drawing a prompt again costs nothing).
        per_step = 4 * (per_step + over)
    data["orchestrator"]["epochs"] = math.ceil(cfg.rl_steps * per_step / n_train)
    if cfg.train_seed is not None:  # another draw of the training on the same world
        data["orchestrator"]["data"]["seed"] = cfg.train_seed
        data["trainer"]["model"]["seed"] = cfg.train_seed
    data["trainer"]["model"]["path"] = str(model_dir.resolve())
    data["trainer"]["backend"] = cfg.trainer_backend
    data["trainer"]["checkpoint"]["dir"] = str(out / "checkpoints")
    data["trainer"]["checkpoint"]["export_dir"] = str(out / "model-trained")
    data["trainer"]["metrics_jsonl"] = str(out / "train_metrics.jsonl")
    data["orchestrator"]["rollout_log"] = {"run_dir": str(out)}  # what `searchr1 inspect` shows
    data["local"]["log_dir"] = str(out / "logs")
    data["local"]["redis_dir"] = str(out / "redis")
    # Free ports, and every URL derived from them: the demo never collides with a server
    # already running here (a user's own retriever on 8000, a test run...).
    ports = {name: free_port() for name in ("retriever", "inference", "orchestrator", "trainer")}
    for name, port in ports.items():
        data[name].setdefault("http", {})["port"] = port
    if cfg.engines > 1:  # inference-i listens on the inference port + i (`searchr1 local`)
        ports["inference"] = free_port_run(cfg.engines)
        data["inference"]["http"]["port"] = ports["inference"]
        data["local"]["inference_replicas"] = cfg.engines
    urls = [f"http://127.0.0.1:{ports['inference'] + i}" for i in range(cfg.engines)]
    data["engines"] = {**data.get("engines", {}), "urls": urls}  # the orchestrator's and pushes'
    data["orchestrator"]["search"]["retriever_url"] = f"http://127.0.0.1:{ports['retriever']}"
    data["trainer"]["weight_push"]["master_port"] = free_port()
    if cfg.engine == "sglang":
        if not cfg.sglang_python:
            raise ValueError("engine sglang needs SGLang's interpreter (--sglang-python)")
        data["inference"]["engine"] = "sglang"
        data["inference"]["sglang"] = cpu_settings(cfg.sglang_python)
        # SGLang does not report its dtype: the trainer casts to the one it was started with.
        data["trainer"]["weight_push"]["dtype"] = data["inference"]["sglang"]["dtype"]
    if cfg.placement == "colocated":  # sync only: the stack config refuses async with it
        data["placement"] = "colocated"  # sets the hand-over and the release (PLACEMENT_SETS)
        push = data["trainer"]["weight_push"]
        push.pop("mode", None)
        data["trainer"]["offload_between_steps"] = ["optimizer", "reference"]
        push.pop("master_port", None)
        push.pop("backend", None)
        if cfg.engine == "sglang":
            push["handover_format"] = "sglang"
    path = out / "stack.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def evaluate(stack: Path, model_dir: Path, data: Path | None, out: Path, limit: int | None) -> dict:
    """Greedy held-out evaluation through the real retriever and engine; `data` None: the
    rows of the stack's task (`orchestrator.task`), through the engine alone.

    In this process (not a `searchr1 eval` child): an interrupt can then never leave an
    evaluation running behind the demo.
    """
    cfg = load_config(stack)
    cfg.local.services = ["retriever", "inference"] if data is not None else ["inference"]
    specs = build_specs(cfg, stack, "redis://127.0.0.1:1/0")
    for spec in specs:
        if spec.name.startswith("inference"):
            spec.command += ["--model", str(model_dir)]
    sup = Supervisor(specs, Path(cfg.local.log_dir) / f"eval-{out.stem}")
    sup.start()
    try:
        if data is not None:
            prompts = load_prompts(data, limit)
        else:
            assert cfg.orchestrator.task is not None, "a task's demo configures its task"
            prompts = load_task(cfg.orchestrator.task).rows("eval")[:limit]
        result = asyncio.run(
            evaluate_served(cfg.orchestrator, cfg.engines, cfg.bus, prompts, run_id=cfg.run.id)
        )
    finally:
        sup.stop()
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def plot(metrics_jsonl: Path, before: float, after: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    steps = [r.get("step", i + 1) for i, r in enumerate(rows)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("reward/mean", "train reward"), ("reward/em", "train EM")):
        if any(key in r for r in rows):
            ax.plot(steps, [r.get(key, float("nan")) for r in rows], label=label)
    last = steps[-1] if steps else 1
    ax.scatter([0, last], [before, after], color="red", zorder=3, label="held-out EM")
    ax.set_xlabel("training step")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("searchr1 demo: a tiny model learns to search")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def summary_row(result: dict[str, Any]) -> dict[str, float]:
    overall = result["overall"]
    return {
        "em": float(overall.get("em", 0.0)),
        "sub_em": float(overall.get("sub_em", 0.0)),
        "searches": float(overall.get("searches_mean", float("nan"))),
        "length": float(overall.get("response_tokens_mean", float("nan"))),
    }


def run_demo(cfg: DemoConfig) -> dict[str, float]:
    if cfg.task == TASK_MULTI_TOOL:
        return run_multitool_demo(cfg)
    if cfg.task != TASK_SEARCH_R1:
        raise ValueError(f"unknown demo task {cfg.task!r} (tasks: {', '.join(TASKS)})")
    start = time.monotonic()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    # Demonstrations show as many documents per search as RL rollouts will get.
    topk = yaml.safe_load(CONFIG_TEMPLATE.read_text())["orchestrator"]["search"]["topk"]
    cfg = replace(cfg, warm_start=replace(cfg.warm_start, topk=topk))
    world = generate_world(cfg.seed, n_people=cfg.n_people)
    files = write_world(world, cfg.out_dir / "world")
    rows = write_rows(world, cfg.out_dir / "data")
    # MiniLM was trained without e5's "query: "/"passage: " prefixes.
    index_dir = cfg.out_dir / "index"
    build_index(files["corpus"], index_dir, BuildConfig(query_prefix="", passage_prefix=""))
    if cfg.warm_start_from is None:
        warm = build_policy(cfg, world)
    else:
        warm = cfg.warm_start_from / "model-warm"
        log.info("warm start reused", extra={"model": str(warm)})
    stack = write_stack_config(cfg, index_dir, warm, rows)

    before = evaluate(stack, warm, rows["test"], cfg.out_dir / "eval_before.json", cfg.eval_limit)
    run_local(load_config(stack), stack, max_steps=cfg.rl_steps)
    trained = cfg.out_dir / "model-trained"
    after = evaluate(stack, trained, rows["test"], cfg.out_dir / "eval_after.json", cfg.eval_limit)

    b, a = summary_row(before), summary_row(after)
    plot(cfg.out_dir / "train_metrics.jsonl", b["em"], a["em"], cfg.out_dir / "demo.png")
    return summarize(b, a, time.monotonic() - start)


def summarize(b: dict[str, float], a: dict[str, float], wall_s: float) -> dict[str, float]:
    """The demo's result (its last line): `summary_row` before and after RL, and the wall time."""
    return {
        "em_before": b["em"],
        "em_after": a["em"],
        "sub_em_before": b["sub_em"],
        "sub_em_after": a["sub_em"],
        "searches_per_question_before": b["searches"],
        "searches_per_question": a["searches"],
        "response_length_before": b["length"],
        "response_length_after": a["length"],
        "wall_s": wall_s,
    }


def run_multitool_demo(cfg: DemoConfig) -> dict[str, float]:
    """`--task multi-tool`: the same stages as `run_demo` over the years world
    (demos/multitool.py); the summary adds calculator calls per question."""
    start = time.monotonic()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    topk = yaml.safe_load(CONFIG_TEMPLATE.read_text())["orchestrator"]["search"]["topk"]
    if not cfg.quick:
        cfg = replace(cfg, warm_start=mt.warm_start_config(cfg.seed, topk))
    else:
        cfg = replace(cfg, warm_start=mt.warm_start_config(cfg.seed, topk, quick=True))
    world = mt.generate_years_world(cfg.seed, n_people=cfg.n_people, n_questions=cfg.n_people)
    rows = mt.write_years_world(world, cfg.out_dir / "data")
    index_dir = cfg.out_dir / "index"
    build_index(rows["corpus"], index_dir, BuildConfig(query_prefix="", passage_prefix=""))
    calculator, calc_name = mt.calculator_tool_config()
    log.info("multi-tool task", extra={"calculator": calculator})
    if cfg.warm_start_from is None:
        warm = build_policy(
            cfg,
            world,
            lambda tok: mt.MultiToolSampler(world, tok, cfg.warm_start, calc_name),
            mt.demonstration_texts(world, calc_name),
            mt.EXTRA_VOCAB_PER_NAME * len(world.people),
        )
    else:
        warm = cfg.warm_start_from / "model-warm"
        log.info("warm start reused", extra={"model": str(warm)})
    stack = write_stack_config(
        cfg, index_dir, warm, rows, lambda data: mt.apply_to_stack_config(data, calculator)
    )
    evals = cfg.out_dir / "rollouts" / "eval"
    before = evaluate(stack, warm, rows["test"], cfg.out_dir / "eval_before.json", cfg.eval_limit)
    calls_before = mt.tool_calls_per_question(_newest(evals))
    run_local(load_config(stack), stack, max_steps=cfg.rl_steps)
    trained = cfg.out_dir / "model-trained"
    after = evaluate(stack, trained, rows["test"], cfg.out_dir / "eval_after.json", cfg.eval_limit)
    calls_after = mt.tool_calls_per_question(_newest(evals))

    b, a = summary_row(before), summary_row(after)
    b["searches"], a["searches"] = calls_before.get("search", 0.0), calls_after.get("search", 0.0)
    plot(cfg.out_dir / "train_metrics.jsonl", b["em"], a["em"], cfg.out_dir / "demo.png")
    result = summarize(b, a, time.monotonic() - start)
    result["calculator_calls_per_question_before"] = calls_before.get(calc_name, 0.0)
    result["calculator_calls_per_question"] = calls_after.get(calc_name, 0.0)
    return result


def _newest(directory: Path) -> Path:
    """The evaluation file written last (the rollout log writes one per evaluation)."""
    files = sorted(directory.glob("*.parquet"), key=lambda p: p.stat().st_mtime_ns)
    if not files:
        raise FileNotFoundError(f"no evaluation in {directory} (orchestrator.rollout_log)")
    return files[-1]
