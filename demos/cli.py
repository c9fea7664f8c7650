"""`searchr1 demo`: the command, its checks and the demo's summary table and last line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from demos.agent import AGENTS, run_agent_demo
from demos.agent import RL_STEPS as AGENT_RL_STEPS
from demos.multitool import calculator_tool_config as multitool_calculator
from demos.run import RL_STEPS, TASK_SEARCH_R1, TASKS, DemoConfig, run_demo
from demos.task import TASK_DEMOS, run_task_demo
from searchr1.logs import setup_logging
from stack.launcher import run_supervised
from trainer.backends.registry import BACKENDS


def demo(
    out: Path = typer.Option(Path("runs/demo"), help="Where every artifact of the run goes."),
    seed: int = typer.Option(0, help="Seed of the world, the model and the training."),
    steps: int | None = typer.Option(
        None,
        min=1,
        help="GRPO steps (default: "
        + ", ".join(f"{n} for {task}" for task, n in RL_STEPS.items())
        + "".join(f", {d.rl_steps} for {task}" for task, d in TASK_DEMOS.items())
        + f", {AGENT_RL_STEPS} with --agent).",
    ),
    quick: bool = typer.Option(False, help="A few steps of everything (minutes)."),
    engine: str = typer.Option(
        "torch", help="Inference service: torch (our reference engine) or sglang (real SGLang)."
    ),
    sglang_python: str | None = typer.Option(
        None,
        envvar="SEARCHR1_SGLANG_PYTHON",
        help="SGLang's interpreter for --engine sglang (`python3 dev.py demo --engine sglang` "
        "builds .venv-sglang and sets it).",
    ),
    engines: int = typer.Option(
        1, min=1, help="Inference processes; the orchestrator routes a group's turns to one."
    ),
    train_seed: int | None = typer.Option(
        None, help="Data order and trainer seed on the same world and warm start (default: seed)."
    ),
    warm_start_from: Path | None = typer.Option(
        None,
        help="A finished demo's --out with the same --seed: reuse its warm-started model "
        "(over --train-seed values, say).",
    ),
    dynamic_sampling: bool = typer.Option(
        False,
        help="DAPO's dynamic sampling: a quarter more groups per step, groups whose rewards are "
        "all equal dropped (orchestrator.rollout.over_sampling, group_filter: reward_std).",
    ),
    trainer_backend: str = typer.Option(
        "hf",
        help="Trainer backend (trainer.backend): hf (Hugging Face model) or megatron "
        "(Megatron-Core, the `megatron` extra; one process on CPU).",
    ),
    task: str = typer.Option(
        TASK_SEARCH_R1,
        help="search-r1: Search-R1's tags, one tool (search); multi-tool: questions that need a "
        "search and arithmetic, search + an MCP calculator in the function-calling format; "
        "guess-number: a game whose environment answers every guess (docs/tasks.md).",
    ),
    agent: str | None = typer.Option(
        None,
        help="openai: the demo's agent as a plain openai-client program "
        "(docs/examples/openai_agent.py, function calling, search) trains through the gateway: "
        "rollouts from `searchr1 agent run`, no orchestrator (docs/gateway.md).",
    ),
    placement: str = typer.Option(
        "disaggregated",
        help="disaggregated (weights broadcast to the engines) or colocated (the engines "
        "release their memory while the trainer trains and take its weights from shared "
        "memory, as slime's --colocate; sync only).",
    ),
) -> None:
    """Offline end-to-end demo: a tiny model learns to search a synthetic world with GRPO."""
    if engine not in ("torch", "sglang"):
        typer.secho(f"error: --engine must be torch or sglang (got {engine!r})", err=True)
        raise typer.Exit(2)
    if engine == "sglang" and not (sglang_python and Path(sglang_python).exists()):
        typer.secho(
            "error: --engine sglang needs --sglang-python (SGLang's interpreter; "
            "`python3 dev.py demo --engine sglang` builds one)",
            err=True,
        )
        raise typer.Exit(2)
    _check_trainer_backend(trainer_backend)
    if placement not in ("disaggregated", "colocated"):
        typer.secho(
            f"error: --placement must be disaggregated or colocated (got {placement!r})", err=True
        )
        raise typer.Exit(2)
    if task not in (*TASKS, *TASK_DEMOS):
        names = ", ".join((*TASKS, *TASK_DEMOS))
        typer.secho(f"error: --task must be one of {names} (got {task!r})", err=True)
        raise typer.Exit(2)
    if agent is not None:
        _check_agent(agent, task, engines, placement, dynamic_sampling)
    if task == "multi-tool":
        try:
            multitool_calculator()
        except FileNotFoundError as e:
            typer.secho(f"error: {e}", err=True)
            raise typer.Exit(2) from None
    if (
        warm_start_from is not None
        and not (warm_start_from / "model-warm" / "config.json").exists()
    ):
        typer.secho(
            f"error: --warm-start-from {warm_start_from}: no model-warm/ there (a finished "
            "demo's --out directory)",
            err=True,
        )
        raise typer.Exit(2)
    setup_logging("demo", "INFO", json_format=False)
    chosen = {
        "engine": engine,
        "sglang_python": sglang_python,
        "trainer_backend": trainer_backend,
        "engines": engines,
        "train_seed": train_seed,
        "dynamic_sampling": dynamic_sampling,
        "warm_start_from": warm_start_from.resolve() if warm_start_from else None,
        "task": task,
        "placement": placement,
    }
    cfg = (
        DemoConfig.quick_mode(out, seed, **chosen)
        if quick
        else DemoConfig(out, seed, rl_steps=steps or default_steps(task, agent), **chosen)
    )
    run = run_agent_demo if agent else run_task_demo if task in TASK_DEMOS else run_demo
    result = run_supervised(lambda: run(cfg))
    print_demo_summary(result, out, engine, trainer_backend)


def default_steps(task: str, agent: str | None = None) -> int:
    if agent is not None:
        return AGENT_RL_STEPS
    return TASK_DEMOS[task].rl_steps if task in TASK_DEMOS else RL_STEPS[task]


def _check_agent(
    agent: str, task: str, engines: int, placement: str, dynamic_sampling: bool
) -> None:
    """Exit 2 on an unknown --agent, or with options of the orchestrator's loop it has not."""
    if agent not in AGENTS:
        typer.secho(f"error: --agent must be {' or '.join(AGENTS)} (got {agent!r})", err=True)
        raise typer.Exit(2)
    refused = {
        "--task": task != TASK_SEARCH_R1,
        "--engines": engines > 1,
        "--placement": placement != "disaggregated",
        "--dynamic-sampling": dynamic_sampling,
    }
    named = [option for option, given in refused.items() if given]
    if named:
        typer.secho(
            f"error: --agent runs its own world and loop through the gateway; "
            f"{', '.join(named)} cannot go with it",
            err=True,
        )
        raise typer.Exit(2)


def _check_trainer_backend(name: str) -> None:
    """Exit 2 on an unknown backend, or on megatron without megatron-core installed (the
    trainer would otherwise fail minutes later, after the warm start)."""
    if name not in BACKENDS:
        choices = " or ".join(BACKENDS)
        typer.secho(f"error: --trainer-backend must be {choices} (got {name!r})", err=True)
        raise typer.Exit(2)
    if name == "megatron" and not _importable("megatron.core"):
        typer.secho(
            "error: --trainer-backend megatron needs megatron-core: "
            "pip install -e '.[megatron]' (or searchr1[megatron])",
            err=True,
        )
        raise typer.Exit(2)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def print_demo_summary(
    result: dict[str, float], out: Path, engine: str, trainer_backend: str
) -> None:
    """The demo's before/after table and its last line of key=value pairs (also printed by the
    compose `cpu` profile's demo-report container)."""
    table = Table(title="held-out set: before vs after RL")
    for col in ("metric", "warm start", "after GRPO"):
        table.add_column(col)
    for key, label in (
        ("em", "exact match"),
        ("sub_em", "sub-EM"),
        ("reward", "reward"),
        ("turns_per_episode", "turns / episode"),
        ("searches_per_question", "searches / question"),
        ("calculator_calls_per_question", "calculator calls / question"),
        ("response_length", "response tokens"),
    ):
        if key.endswith("_per_question") and key not in result:
            continue  # a task without that tool
        if f"{key}_before" not in result and key not in result:
            continue  # a metric this task does not report
        before = result.get(f"{key}_before", float("nan"))
        after = result.get(key if key.endswith("_per_question") else f"{key}_after", float("nan"))
        table.add_row(label, f"{before:.3f}", f"{after:.3f}")
    Console().print(table)
    typer.echo(f"plot: {out / 'demo.png'}  trained model: {out / 'model-trained'}")
    typer.echo(f"see the rollouts and curves: searchr1 inspect {out}")
    pairs = " ".join(f"{k}={v:.3f}" for k, v in result.items())
    typer.echo(f"{pairs} engine={engine} trainer_backend={trainer_backend}")
