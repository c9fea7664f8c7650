"""`searchr1 inspect RUN_DIR`: serve the inspector over one run directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from inspector.config import InspectorConfig, InspectorHttpConfig
from inspector.server import create_app
from searchr1.logs import setup_logging
from searchr1.service import run_http


def inspect_command(
    run_dir: Annotated[
        Path, typer.Argument(help="A run directory (e.g. runs/demo).", file_okay=False)
    ],
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8200,
    host: Annotated[
        str, typer.Option(help="Interface; beyond loopback anyone reaching it reads the run.")
    ] = "127.0.0.1",
) -> None:
    """A web page over a run: curves, steps, rollouts with their loss masks, comparisons."""
    if not run_dir.is_dir():
        typer.secho(f"error: {run_dir} is not a directory", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    setup_logging("inspector", json_format=False)
    # The inspector has no guarded routes: it only reads the run directory.
    cfg = InspectorConfig(http=InspectorHttpConfig(host=host, port=port, auth="none"))
    typer.echo(f"inspecting {run_dir} at http://{host}:{port}/")
    run_http(create_app(run_dir, cfg), cfg.http)


app = typer.Typer(help="Inspect a run directory in the browser.", no_args_is_help=True)
app.command("inspect")(inspect_command)

if __name__ == "__main__":
    app()
