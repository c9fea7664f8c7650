"""`searchr1 gateway ...` (the OpenAI-compatible gateway) and `searchr1 agent ...` (agent
programs run against it): each checks what it can, then hands over to `gateway.wiring`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

from gateway.config import GatewaySettings
from gateway.wiring import run_agents, serve
from searchr1.cli_common import ConfigOption, add_show_config, start_service
from searchr1.dotted import load_object

app = typer.Typer(
    help="The OpenAI-compatible gateway: agent programs' chat calls in, token-exact "
    "trajectories onto the bus (docs/gateway.md).",
    no_args_is_help=True,
)
agent_app = typer.Typer(
    help="Run an agent program N times per row against the gateway (docs/gateway.md).",
    no_args_is_help=True,
)
add_show_config(app, GatewaySettings, "gateway")


def _fail(msg: str) -> typer.Exit:
    typer.secho(f"error: {msg}", err=True, fg=typer.colors.RED)
    return typer.Exit(2)


@app.command("serve")
def serve_command(
    config: ConfigOption = None,
    port: Annotated[int | None, typer.Option(help="Listen port (overrides http.port).")] = None,
    engine_url: Annotated[
        str | None, typer.Option(help="The engine (overrides gateway.engine_url).")
    ] = None,
) -> None:
    """Serve /v1/chat/completions and the session routes until SIGTERM."""
    cfg = start_service("gateway", GatewaySettings, config)
    gw = cfg.gateway
    if port is not None:
        gw.http.port = port
    if engine_url is not None:
        gw.engine_url = engine_url
    if not cfg.redis.url:
        raise _fail("redis.url is not set (SEARCHR1_REDIS__URL): trajectories go to the bus")
    raise typer.Exit(asyncio.run(serve(gw, cfg.redis.url, cfg.bus, cfg.admin_token, cfg.engines)))


@agent_app.command("run")
def run_command(
    config: ConfigOption = None,
    program: Annotated[
        str | None,
        typer.Option(help="`module:function` or `/path/file.py:function` (agent.program)."),
    ] = None,
    data: Annotated[Path | None, typer.Option(help="Rows, JSON lines (agent.data_path).")] = None,
    gateway_url: Annotated[str | None, typer.Option(help="agent.gateway_url")] = None,
    samples: Annotated[
        int | None, typer.Option("-n", "--samples", min=1, help="Sessions per row.")
    ] = None,
    reward: Annotated[str | None, typer.Option(help="Reward function f(row, result).")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N rows.")] = None,
    task: Annotated[
        str | None,
        typer.Option(help="A task's rows and rubric (agent.task): built-in name or dotted path."),
    ] = None,
    task_options: Annotated[
        str | None, typer.Option(help="The task's options, a JSON object (agent.task_options).")
    ] = None,
    split: Annotated[
        str | None, typer.Option(help="The task's rows: train or eval (agent.split).")
    ] = None,
    run_id: Annotated[
        str | None, typer.Option(help="Names sessions and groups (default: run.id).")
    ] = None,
) -> None:
    """Run the program on every row, N sessions per row in parallel; print the outcomes."""
    cfg = start_service("agent", GatewaySettings, config)
    agent = cfg.agent
    options = None
    if task_options is not None:
        try:
            options = json.loads(task_options)
        except json.JSONDecodeError as e:
            raise _fail(f"--task-options: not JSON: {e}") from None
        if not isinstance(options, dict):
            raise _fail("--task-options: must be a JSON object")
    if split is not None and split not in ("train", "eval"):
        raise _fail(f"--split: {split!r} is not train or eval")
    updates = {
        "program": program,
        "data_path": str(data) if data else None,
        "gateway_url": gateway_url,
        "samples_per_row": samples,
        "reward": reward,
        "limit": limit,
        "task": task,
        "task_options": options,
        "split": split,
    }
    agent = agent.model_copy(update={k: v for k, v in updates.items() if v is not None})
    try:  # a typo in a dotted path fails here, before any session
        for path in (agent.program, agent.reward):
            if path:
                load_object(path)
        summary = asyncio.run(
            run_agents(
                agent,
                run_id=run_id or cfg.run.id,
                group_size=cfg.run.group_size,
                token=cfg.admin_token,
            )
        )
    except (ValueError, ImportError, AttributeError, OSError) as e:
        raise _fail(str(e)) from None
    counts = " ".join(f"{k}={v}" for k, v in sorted(summary.counts().items()))
    mean = summary.mean_reward()
    typer.echo(
        f"sessions={len(summary.sessions)} {counts} "
        f"mean_reward={'-' if mean is None else f'{mean:.4f}'}"
    )
    raise typer.Exit(0 if any(s.outcome == "rewarded" for s in summary.sessions) else 1)
