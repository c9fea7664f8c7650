"""The `searchr1` command: one sub-command group per service, plus bus and config tools."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

# Before anything imports torch/numpy: with several services on a few cores, default thread
# pools oversubscribe and run 10-100x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import click
import typer
from typer.core import TyperGroup

from searchr1.bus import TrajectoryBus
from searchr1.cli_common import ConfigOption, load_or_exit, print_section
from searchr1.dotted import load_object
from searchr1.logs import setup_logging
from stack.config import StackConfig
from stack.launcher import run_local, run_supervised
from stack.scale import control_file, request_scale

# Sub-command -> the dotted path of its typer app (or command function), imported only when the
# sub-command runs: a service process loads its own package, not every service's (torch,
# faiss, transformers...). Every service's CLI is the first hop of `cli -> wiring -> loop`.
COMMANDS: dict[str, str] = {
    "retriever": "retriever.cli:app",
    "inference": "inference.cli:app",
    "orchestrator": "orchestrator.cli:app",
    "trainer": "trainer.cli:app",
    "data": "orchestrator.cli:data_app",
    "eval": "orchestrator.cli:eval_command",
    "inspect": "inspector.cli:inspect_command",
    "demo": "demos.cli:demo",
    "task": "stack.task_cli:app",
    "gateway": "gateway.cli:app",
    "agent": "gateway.cli:agent_app",
}


def load_command(name: str, target: str) -> click.Command:
    """The click command of `module:attr`: a typer app (always a group, even with one
    sub-command, as `add_typer` makes it) or a plain command function."""
    obj = load_object(target)
    if isinstance(obj, typer.Typer):
        command: click.Command = typer.main.get_group(obj)
    else:
        single = typer.Typer()
        single.command(name)(obj)
        command = typer.main.get_command(single)
    command.name = name
    return command


class LazyCommands(TyperGroup):
    """The root group: its own commands plus COMMANDS, each loaded when first named."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS:
            return load_command(cmd_name, COMMANDS[cmd_name])
        return super().get_command(ctx, cmd_name)


app = typer.Typer(
    cls=LazyCommands,
    help="searchr1: train LMs to reason and search with multi-turn RL (the Search-R1 recipe).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

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
    print_section(load_or_exit(StackConfig, config))


def _bus_from(config: ConfigOption) -> TrajectoryBus:
    cfg = load_or_exit(StackConfig, config)
    if not cfg.redis.url:
        typer.secho("error: redis.url is not set (SEARCHR1_REDIS__URL)", err=True, fg="red")
        raise typer.Exit(2)
    return TrajectoryBus.from_url(cfg.redis.url, cfg.bus)


def _with_bus(config: ConfigOption, job: Callable[[TrajectoryBus], Awaitable[None]]) -> None:
    async def run() -> None:
        bus = _bus_from(config)
        try:
            await job(bus)
        finally:
            await bus.close()

    asyncio.run(run())


@bus_app.command("stats")
def bus_stats(config: ConfigOption = None) -> None:
    """Backlog, pending and dead-letter counts of the trajectory stream."""

    async def stats(bus: TrajectoryBus) -> None:
        await bus.ensure_group()
        backlog = await bus.backlog()
        pending = await bus.pending_count()
        dead = await bus.dead_letter_count()
        typer.echo(
            f"stream={bus.stream} group={bus.group} backlog={backlog} "
            f"pending={pending} undelivered={backlog - pending} dead_letters={dead}"
        )

    _with_bus(config, stats)


@bus_app.command("dead-letters")
def bus_dead_letters(
    config: ConfigOption = None,
    count: int = typer.Option(20, min=1, help="How many to show, oldest first."),
) -> None:
    """List dead-lettered entries: why each was rejected, its trajectory id and the error."""

    def text(row: dict[str, object], key: str) -> str:
        value = row.get(key, b"")
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

    async def show(bus: TrajectoryBus) -> None:
        for row in await bus.dead_letters(count):
            # Entries dead-lettered before `reason` existed kept it in `error`.
            reason = text(row, "reason") or text(row, "error")
            typer.echo(
                f"{row['id']} source={text(row, 'source_id')} tid={text(row, 'tid')} "
                f"reason={reason} deliveries={text(row, 'deliveries') or '?'} "
                f"size={len(row.get('data', b''))} error={text(row, 'error')!r}"
            )

    _with_bus(config, show)


local_app = typer.Typer(
    invoke_without_command=True,
    no_args_is_help=False,
    help="Run the whole stack on this machine as supervised processes (Ctrl-C stops it "
    "cleanly); `local scale` changes the number of engines of a running one.",
)
app.add_typer(local_app, name="local")


@local_app.command("scale")
def local_scale(
    config: ConfigOption = None,
    engines: int | None = typer.Option(
        None, min=1, help="Engines wanted (none: list them). Needs local.control_port."
    ),
) -> None:
    """Scale the engines of a running `searchr1 local` (started with the same --config): added
    engines pull the current weights and join without pausing the others."""
    if config is None:
        typer.secho("error: --config is required (the running launcher's)", err=True)
        raise typer.Exit(2)
    cfg = load_or_exit(StackConfig, config)
    try:
        answer = request_scale(control_file(cfg.local.log_dir), engines)
    except (ValueError, OSError) as e:
        typer.secho(f"error: {e}", err=True, fg="red")
        raise typer.Exit(1) from None
    for engine in answer["engines"]:
        typer.echo(f"{engine['name']}\t{engine['url']}\t{engine['status']}")


@local_app.callback()
def local(
    ctx: typer.Context,
    config: ConfigOption = None,
    max_steps: int | None = typer.Option(None, min=1, help="Progress bar total (trainer steps)."),
) -> None:
    """Run the whole stack on this machine as supervised processes (Ctrl-C stops it cleanly)."""
    if ctx.invoked_subcommand is not None:
        return
    if config is None:
        typer.secho("error: --config is required (the same file every service reads)", err=True)
        raise typer.Exit(2)
    cfg = load_or_exit(StackConfig, config)
    setup_logging("local", cfg.logging.level, json_format=False)
    run_supervised(lambda: run_local(cfg, config.resolve(), max_steps=max_steps))


def main() -> None:
    # Here, not at the top: searchr1.service loads FastAPI and uvicorn, which `--help` and the
    # sub-commands that serve nothing do not need.
    from searchr1.service import InsecureListener

    try:
        app()
    except InsecureListener as e:  # a refused configuration, not a crash: no traceback
        typer.secho(f"error: {e}", err=True, fg="red")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
