"""`searchr1 trainer ...`: the trainer's commands; `run` -> `trainer.wiring.run_trainer`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from searchr1.cli_common import ConfigOption, add_show_config, load_or_exit, start_service
from searchr1.settings import ConfigError
from trainer.checkpoint import SHARDS, CheckpointManager
from trainer.config import CheckpointConfig, TrainerSettings
from trainer.dist import close_distributed
from trainer.wiring import export_checkpoint, run_trainer

app = typer.Typer(
    help="GRPO training from the trajectory bus; checkpoints; weight pushes to inference.",
    no_args_is_help=True,
)


add_show_config(app, TrainerSettings, "trainer")


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg="red")
    return typer.Exit(2)


@app.command("run")
def run(
    config: ConfigOption = None,
    model: Annotated[
        str | None, typer.Option(help="HF model directory (trainer.model.path).")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume/--fresh", help="Continue from the latest checkpoint if any.")
    ] = True,
    port: Annotated[int | None, typer.Option(help="Listen port (overrides http.port).")] = None,
    max_steps: Annotated[
        int | None, typer.Option(min=1, help="Stop after this many steps.")
    ] = None,
) -> None:
    """Train: consume trajectories from the bus, step, checkpoint, ack, push weights.

    Launch with `torchrun --nproc-per-node N -m stack.cli trainer run ...` for FSDP2."""
    cfg = start_service("trainer", TrainerSettings, config)
    section = cfg.trainer
    if model is not None:
        section.model.path = model
    if port is not None:
        section.http.port = port
    if max_steps is not None:
        cfg.run.max_steps = max_steps
    if not section.model.path:
        raise _fail("trainer.model.path is not set (--model)")
    if not Path(section.model.path).is_dir():
        raise _fail(f"trainer.model.path: {section.model.path} is not a directory")
    if not cfg.redis.url:
        raise _fail("redis.url is not set (SEARCHR1_REDIS__URL)")
    try:
        code = asyncio.run(run_trainer(cfg, resume=resume))
    except ConfigError as e:
        raise _fail(str(e)) from None
    if code == 0:
        close_distributed()
    raise typer.Exit(code)


def _checkpoint_path(path: Path) -> Path | None:
    """`path` itself when it is one checkpoint, else the latest one under it (None: neither)."""
    if (path / "trainer.json").exists():
        return path
    return CheckpointManager(CheckpointConfig(dir=str(path))).latest()


@app.command("export-hf")
def export_hf(
    checkpoint: Annotated[
        Path,
        typer.Argument(help="A checkpoint (step_NNNNNNNN) or a checkpoint directory (its latest)."),
    ],
    out: Annotated[Path, typer.Argument(help="Directory to write the HF model into.")],
    config: ConfigOption = None,
    model: Annotated[
        str | None, typer.Option(help="Base HF model directory (trainer.model.path).")
    ] = None,
) -> None:
    """Write a checkpoint's weights as a plain Hugging Face directory (safetensors, config,
    tokenizer) that the reference engine and SGLang load. Either backend (`trainer.backend`):
    a Megatron checkpoint of any TP x PP x DP layout is read in this one process."""
    section = load_or_exit(TrainerSettings, config).trainer
    if model is not None:
        section.model.path = model
    if not section.model.path:
        raise _fail("trainer.model.path is not set (--model)")
    path = _checkpoint_path(checkpoint)
    if path is None or not (path / "state.pt").exists():
        raise _fail(f"no checkpoint found at {checkpoint}")
    if (path / SHARDS).is_dir() and section.backend != "megatron":
        raise _fail(f"{path} was written by the Megatron backend: set trainer.backend: megatron")
    typer.echo(str(export_checkpoint(section, path, out)))
