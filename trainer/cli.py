"""`searchr1 trainer ...`: command-line wiring of the trainer service."""

from __future__ import annotations

import typer

from searchr1.cli_common import ConfigOption, load_or_exit, print_section

app = typer.Typer(
    help="GRPO training from the trajectory bus; checkpoints; weight pushes to inference.",
    no_args_is_help=True,
)


@app.command("show-config")
def show_config(config: ConfigOption = None) -> None:
    """Print the effective trainer section (file + environment + defaults)."""
    print_section(load_or_exit(config).trainer)
