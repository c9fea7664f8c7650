"""`searchr1 inference ...`: command-line wiring of the inference service."""

from __future__ import annotations

import typer

from searchr1.cli_common import ConfigOption, load_or_exit, print_section

app = typer.Typer(
    help="Rollout generation: the SGLang HTTP protocol (SGLang on GPU, a reference engine on CPU).",
    no_args_is_help=True,
)


@app.command("show-config")
def show_config(config: ConfigOption = None) -> None:
    """Print the effective inference section (file + environment + defaults)."""
    print_section(load_or_exit(config).inference)
