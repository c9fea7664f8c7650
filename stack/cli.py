"""The `searchr1` command: one sub-command group per service, plus bus and config tools."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

# Before anything imports torch/numpy: with several services on a few cores, default thread
# pools oversubscribe and run 10-100x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import typer

from inference.cli import app as inference_app
from inspector.cli import inspect_command
from orchestrator.cli import app as orchestrator_app
from orchestrator.cli import data_app, eval_command
from retriever.cli import app as retriever_app
from searchr1.cli_common import ConfigOption, load_or_exit
from stack.config import StackConfig
from trainer.cli import app as trainer_app

T = TypeVar("T")

app = typer.Typer(
    help="searchr1: train LMs to reason and search with multi-turn RL (the Search-R1 recipe).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(retriever_app, name="retriever")
app.add_typer(inference_app, name="inference")
app.add_typer(orchestrator_app, name="orchestrator")
app.add_typer(trainer_app, name="trainer")
app.add_typer(data_app, name="data")
app.command("eval")(eval_command)
app.command("inspect")(inspect_command)

config_app = typer.Typer(help="Inspect and validate the stack configuration.", no_args_is_help=True)
bus_app = typer.Typer(help="Inspect the trajectory bus (Redis streams).", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(bus_app, name="bus")


@config_app.command("validate")
def config_validate(config: ConfigOption = None) -> None:
    """Load the config (file + environment); exit 2 naming each invalid field."""
    load_or_exit(StackConfig, config)
    typer.echo("config ok")


@config_app.command("show")
def config_show(config: ConfigOption = None) -> None:
    """Print the whole effective configuration as YAML (secrets masked)."""
    import yaml

    cfg = load_or_exit(StackConfig, config)
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())


def _bus_from(config: ConfigOption):  # type: ignore[no-untyped-def]
    from searchr1.bus import TrajectoryBus

    cfg = load_or_exit(StackConfig, config)
    if not cfg.redis.url:
        typer.secho("error: redis.url is not set (SEARCHR1_REDIS__URL)", err=True, fg="red")
        raise typer.Exit(2)
    return TrajectoryBus.from_url(cfg.redis.url, cfg.bus)


@bus_app.command("stats")
def bus_stats(config: ConfigOption = None) -> None:
    """Backlog, pending and dead-letter counts of the trajectory stream."""

    async def run() -> None:
        bus = _bus_from(config)
        try:
            await bus.ensure_group()
            backlog = await bus.backlog()
            pending = await bus.pending_count()
            dead = await bus.dead_letter_count()
            typer.echo(
                f"stream={bus.stream} group={bus.group} backlog={backlog} "
                f"pending={pending} undelivered={backlog - pending} dead_letters={dead}"
            )
        finally:
            await bus.close()

    asyncio.run(run())


@bus_app.command("dead-letters")
def bus_dead_letters(
    config: ConfigOption = None,
    count: int = typer.Option(20, min=1, help="How many to show, oldest first."),
) -> None:
    """List dead-lettered entries: why each was rejected, its trajectory id and the error."""

    def text(row: dict[str, object], key: str) -> str:
        value = row.get(key, b"")
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

    async def run() -> None:
        bus = _bus_from(config)
        try:
            for row in await bus.dead_letters(count):
                # Entries dead-lettered before `reason` existed kept it in `error`.
                reason = text(row, "reason") or text(row, "error")
                typer.echo(
                    f"{row['id']} source={text(row, 'source_id')} tid={text(row, 'tid')} "
                    f"reason={reason} deliveries={text(row, 'deliveries') or '?'} "
                    f"size={len(row.get('data', b''))} error={text(row, 'error')!r}"
                )
        finally:
            await bus.close()

    asyncio.run(run())


def _run_supervised(fn: Callable[[], T]) -> T:
    """Run a job that starts service processes. SIGTERM takes Ctrl-C's path, so every `finally`
    stops its children (no orphans): exit 130; a dead child: its report, exit 1."""
    import signal

    from searchr1.supervisor import ChildFailed

    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return fn()
    except ChildFailed as e:
        typer.secho(f"error: {e}", err=True, fg="red")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("stopped")
        raise typer.Exit(130) from None


@app.command("local")
def local(
    config: ConfigOption = None,
    max_steps: int | None = typer.Option(None, min=1, help="Progress bar total (trainer steps)."),
) -> None:
    """Run the whole stack on this machine as supervised processes (Ctrl-C stops it cleanly)."""
    from searchr1.logs import setup_logging
    from stack.launcher import run_local

    if config is None:
        typer.secho("error: --config is required (the same file every service reads)", err=True)
        raise typer.Exit(2)
    cfg = load_or_exit(StackConfig, config)
    setup_logging("local", cfg.logging.level, json_format=False)
    _run_supervised(lambda: run_local(cfg, config.resolve(), max_steps=max_steps))


@app.command("demo")
def demo(
    out: Path = typer.Option(Path("runs/demo"), help="Where every artifact of the run goes."),
    seed: int = typer.Option(0, help="Seed of the world, the model and the training."),
    steps: int = typer.Option(30, min=1, help="GRPO steps."),
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
    trainer_backend: str = typer.Option(
        "hf",
        help="Trainer backend (trainer.backend): hf (Hugging Face model) or megatron "
        "(Megatron-Core, the `megatron` extra; one process on CPU).",
    ),
) -> None:
    """Offline end-to-end demo: a tiny model learns to search a synthetic world with GRPO."""
    from searchr1.logs import setup_logging
    from stack.demo import DemoConfig, run_demo

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
    setup_logging("demo", "INFO", json_format=False)
    chosen = {"engine": engine, "sglang_python": sglang_python, "trainer_backend": trainer_backend}
    cfg = (
        DemoConfig.quick_mode(out, seed, **chosen)
        if quick
        else DemoConfig(out, seed, rl_steps=steps, **chosen)
    )
    result = _run_supervised(lambda: run_demo(cfg))
    print_demo_summary(result, out, engine, trainer_backend)


def _check_trainer_backend(name: str) -> None:
    """Exit 2 on an unknown backend, or on megatron without megatron-core installed (the
    trainer would otherwise fail minutes later, after the warm start)."""
    from trainer.config import BackendKind

    if name not in {b.value for b in BackendKind}:
        choices = " or ".join(b.value for b in BackendKind)
        typer.secho(f"error: --trainer-backend must be {choices} (got {name!r})", err=True)
        raise typer.Exit(2)
    if name == BackendKind.MEGATRON and not _importable("megatron.core"):
        typer.secho(
            "error: --trainer-backend megatron needs megatron-core: "
            "pip install -e '.[megatron]' (or searchr1[megatron])",
            err=True,
        )
        raise typer.Exit(2)


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def print_demo_summary(
    result: dict[str, float], out: Path, engine: str, trainer_backend: str
) -> None:
    """The demo's before/after table and its last line of key=value pairs (also printed by the
    compose `cpu` profile's demo-report container)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="held-out set: before vs after RL")
    for col in ("metric", "warm start", "after GRPO"):
        table.add_column(col)
    for key, label in (
        ("em", "exact match"),
        ("sub_em", "sub-EM"),
        ("searches_per_question", "searches / question"),
        ("response_length", "response tokens"),
    ):
        before = result.get(f"{key}_before", float("nan"))
        after = result.get(key if key == "searches_per_question" else f"{key}_after", float("nan"))
        table.add_row(label, f"{before:.3f}", f"{after:.3f}")
    Console().print(table)
    typer.echo(f"plot: {out / 'demo.png'}  trained model: {out / 'model-trained'}")
    typer.echo(f"see the rollouts and curves: searchr1 inspect {out}")
    pairs = " ".join(f"{k}={v:.3f}" for k, v in result.items())
    typer.echo(f"{pairs} engine={engine} trainer_backend={trainer_backend}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
