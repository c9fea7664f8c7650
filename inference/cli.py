"""`searchr1 inference ...`: command-line wiring of the inference service."""

from __future__ import annotations

import asyncio
import json
import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from engine_client.client import InferenceClient, InferenceError
from inference.config import InferenceSettings
from inference.tiny_model import make_tiny_model
from searchr1.cli_common import ConfigOption, add_show_config, start_service
from searchr1.weightsync.protocol import EngineRefused

app = typer.Typer(
    help="Rollout generation: the SGLang HTTP protocol (SGLang on GPU, a reference engine on CPU).",
    no_args_is_help=True,
)


add_show_config(app, InferenceSettings, "inference")


@app.command("make-tiny-model")
def make_tiny_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    hidden_size: Annotated[int, typer.Option(min=16)] = 64,
    num_layers: Annotated[int, typer.Option(min=1)] = 2,
) -> None:
    """Build a tiny random Qwen2 model + BPE tokenizer offline (Hugging Face directory)."""
    path = make_tiny_model(out_dir, seed=seed, hidden_size=hidden_size, num_layers=num_layers)
    typer.echo(str(path))


class EngineKind(StrEnum):
    torch = "torch"
    sglang = "sglang"


@app.command("serve")
def serve(
    config: ConfigOption = None,
    engine: Annotated[
        EngineKind | None, typer.Option(help="torch (reference, CPU/GPU) or sglang")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Local Hugging Face model directory.")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (overrides http.port).")] = None,
    host: Annotated[str | None, typer.Option(help="Listen host (overrides http.host).")] = None,
    replicas: Annotated[
        int, typer.Option(min=1, help="sglang only: N servers behind sglang-router.")
    ] = 1,
) -> None:
    """Serve SGLang's native HTTP API: the reference engine, or a supervised SGLang."""
    cfg = start_service("inference", InferenceSettings, config)
    section = cfg.inference
    if engine is not None:
        section.engine = engine.value
    if model is not None:
        section.model_path = model
    if port is not None:
        section.http.port = port
    if host is not None:
        section.http.host = host
    if not section.model_path:
        typer.secho("error: inference.model_path is not set (--model)", err=True, fg="red")
        raise typer.Exit(2)
    if section.engine == "sglang" and (section.join.store_dir or section.join.announce):
        typer.secho(
            "error: inference.join (pulling from the weight store, announcing) is our engine's "
            "(--engine torch); SGLang engines get the current weights by a push",
            err=True,
            fg="red",
        )
        raise typer.Exit(2)
    if section.join.announce and not cfg.redis.url:
        typer.secho(
            "error: inference.join.announce needs redis.url (the engine registry)",
            err=True,
            fg="red",
        )
        raise typer.Exit(2)
    if section.engine == "torch":
        if replicas != 1:
            typer.secho("error: --replicas needs --engine sglang", err=True, fg="red")
            raise typer.Exit(2)
        if not Path(section.model_path).is_dir():
            typer.secho(
                f"error: inference.model_path: {section.model_path} is not a directory",
                err=True,
                fg="red",
            )
            raise typer.Exit(2)
    # Lazy: the engine loads torch, which `inference --help` and `show-config` do not need.
    from inference import wiring

    raise typer.Exit(wiring.serve(cfg, replicas=replicas))


@app.command("push-weights")
def push_weights(
    checkpoint: Annotated[Path, typer.Argument(help="Directory with *.safetensors to send.")],
    engine_url: Annotated[
        list[str], typer.Option("--engine-url", help="Engine base URL (repeat for several).")
    ],
    master_port: Annotated[int, typer.Option(help="Port of the weight group's rendezvous.")],
    master_addr: Annotated[str, typer.Option(help="Address engines reach us at.")] = "127.0.0.1",
    backend: Annotated[str, typer.Option(help="gloo (CPU) or nccl (GPU)")] = "gloo",
    bucket_mb: Annotated[int, typer.Option(min=1)] = 256,
    group_name: Annotated[str, typer.Option()] = "searchr1-weights",
    dtype: Annotated[
        str | None,
        typer.Option(help="The engines' dtype (float32, bfloat16, float16); default: as served."),
    ] = None,
) -> None:
    """Broadcast a checkpoint to running engines (a trainer's weight update, standalone).

    Prints one JSON line: bytes, seconds, GB/s and the new weight_version.
    """
    from safetensors.torch import load_file

    # Lazy: torch (the broadcast), which `inference --help` and `show-config` do not need.
    from searchr1.weightsync import group, sender

    try:
        engine_dtype = group.dtype_from_name(dtype) if dtype else None
    except ValueError as e:
        typer.secho(f"error: --dtype: {e}", err=True, fg="red")
        raise typer.Exit(2) from None
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        typer.secho(f"error: checkpoint: no *.safetensors in {checkpoint}", err=True, fg="red")
        raise typer.Exit(2)

    async def run() -> dict[str, float]:
        token = os.environ.get("SEARCHR1_ADMIN_TOKEN")
        clients = [InferenceClient(u, token=token) for u in engine_url]
        await _refuse_routers(clients)
        ws = sender.WeightSender(
            clients,
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
            group_name=group_name,
            bucket_bytes=bucket_mb << 20,
            dtype=engine_dtype,
        )
        try:
            await ws.connect()
            tensors = [item for f in files for item in load_file(str(f)).items()]
            stats = await ws.push(tensors)
        finally:
            await ws.close()
        return {
            "bytes": stats.bytes,
            "seconds": round(stats.seconds, 4),
            "gb_per_s": round(stats.gbytes_per_s, 3),
            "weight_version": stats.weight_version,
        }

    try:
        typer.echo(json.dumps(asyncio.run(run())))
    except (InferenceError, EngineRefused) as e:
        typer.secho(f"error: {e}", err=True, fg="red")
        raise typer.Exit(1) from None


async def _refuse_routers(clients: list[InferenceClient]) -> None:
    """sglang-router has no weight routes (its 404 would fail the join): name its workers,
    which take the push directly. A URL that cannot be asked is left to the join to report."""
    for c in clients:
        try:
            workers = await c.router_workers()
        except InferenceError:
            continue
        if workers:
            for other in clients:
                await other.aclose()
            hint = " ".join(f"--engine-url {w}" for w in workers)
            raise InferenceError(
                f"--engine-url {c.base_url} is sglang-router, which has no weight routes: "
                f"push to its workers ({hint})"
            )
