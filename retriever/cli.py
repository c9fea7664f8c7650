"""`searchr1 retriever ...`: command-line wiring of the retriever service."""

from __future__ import annotations

import typer

from searchr1.cli_common import ConfigOption, load_or_exit, print_section

app = typer.Typer(
    help="Search service: drop-in Search-R1 /retrieve API (HTTP + gRPC), dense/BM25/web backends.",
    no_args_is_help=True,
)


@app.command("show-config")
def show_config(config: ConfigOption = None) -> None:
    """Print the effective retriever section (file + environment + defaults)."""
    print_section(load_or_exit(config).retriever)
