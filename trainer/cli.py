"""`searchr1 trainer ...`: command-line wiring of the trainer service."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from searchr1.cli_common import ConfigOption, add_show_config, load_or_exit, start_service
from trainer.config import TrainerConfig, TrainerSettings

if TYPE_CHECKING:
    from trainer.backend import TrainerBackend
    from trainer.dist import DistInfo

app = typer.Typer(
    help="GRPO training from the trajectory bus; checkpoints; weight pushes to inference.",
    no_args_is_help=True,
)


add_show_config(app, TrainerSettings, "trainer")


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg="red")
    return typer.Exit(2)


def _backend(section: TrainerConfig, info: DistInfo) -> TrainerBackend:
    """The configured backend (`trainer.backend`) over the joined ranks."""
    from trainer.config import BackendKind

    if section.backend == BackendKind.MEGATRON:
        from trainer.backends.megatron.backend import load_megatron_backend

        return load_megatron_backend(section, info)
    from trainer.backends.hf import HFBackend, load_hf_model

    return HFBackend(load_hf_model(section), section, info)


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
    import asyncio

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

    import torch

    from trainer.dist import init_distributed
    from trainer.loop import TrainingLoop
    from trainer.server import make_bus, run_follower, serve_trainer
    from trainer.weights import WeightPusher

    info = init_distributed(section.model.device)
    torch.manual_seed(section.model.seed)
    token = cfg.admin_token.get_secret_value() if cfg.admin_token else None
    try:
        pusher = WeightPusher(section.weight_push, token=token)
    except ValueError as e:
        raise _fail(str(e)) from None
    backend = _backend(section, info)
    bus = make_bus(cfg.redis.url, cfg.bus) if info.rank == 0 else None
    loop = TrainingLoop(section, backend, info, run=cfg.run, bus=bus, pusher=pusher)
    if bus is not None:
        code = asyncio.run(serve_trainer(loop, bus, section.http, resume=resume))
    else:
        code = asyncio.run(run_follower(loop, resume=resume))
    raise typer.Exit(code)


def _checkpoint_path(path: Path) -> Path | None:
    """`path` itself when it is one checkpoint, else the latest one under it (None: neither)."""
    from trainer.checkpoint import CheckpointManager
    from trainer.config import CheckpointConfig

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
    from trainer.checkpoint import SHARDS, CheckpointManager
    from trainer.config import BackendKind, CheckpointConfig
    from trainer.dist import init_distributed

    section = load_or_exit(TrainerSettings, config).trainer
    if model is not None:
        section.model.path = model
    if not section.model.path:
        raise _fail("trainer.model.path is not set (--model)")
    path = _checkpoint_path(checkpoint)
    if path is None or not (path / "state.pt").exists():
        raise _fail(f"no checkpoint found at {checkpoint}")
    if (path / SHARDS).is_dir() and section.backend != BackendKind.MEGATRON:
        raise _fail(f"{path} was written by the Megatron backend: set trainer.backend: megatron")
    section.loss.kl_coef = 0.0  # no reference model needed to export
    # One CPU process: a Megatron checkpoint names no layout, any layout reads it back.
    section.megatron.tp = section.megatron.pp = 1
    section.model.device = "cpu"
    backend = _backend(section, init_distributed("cpu"))
    CheckpointManager(CheckpointConfig(dir=str(path.parent))).load(backend, path, weights_only=True)
    typer.echo(str(backend.export_hf(out)))
