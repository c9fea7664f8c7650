"""`searchr1 orchestrator ...`: command-line wiring of the orchestrator service."""

from __future__ import annotations

import typer

from searchr1.cli_common import ConfigOption, load_or_exit, print_section

app = typer.Typer(
    help="Multi-turn search rollouts, rewards, and the trajectory stream into Redis.",
    no_args_is_help=True,
)


@app.command("show-config")
def show_config(config: ConfigOption = None) -> None:
    """Print the effective orchestrator section (file + environment + defaults)."""
    print_section(load_or_exit(config).orchestrator)
