"""Small helpers shared by every service's CLI: the --config option and config loading."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, TypeVar

import typer
import yaml
from pydantic import BaseModel

from searchr1.logs import setup_logging
from searchr1.settings import ConfigError, ServiceSettings, load_settings

S = TypeVar("S", bound=ServiceSettings)

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="Stack config YAML (sections per service); env SEARCHR1_<SECTION>__<FIELD> overrides.",
        envvar="SEARCHR1_CONFIG",
        dir_okay=False,
    ),
]


def load_or_exit(cls: type[S], path: Path | None) -> S:
    """Load the settings, or print the offending fields and exit with status 2."""
    try:
        return load_settings(cls, path)
    except ConfigError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from None


def start_service(service: str, cls: type[S], path: Path | None) -> S:
    """Load the settings and set up logging for a long-running service process."""
    cfg = load_or_exit(cls, path)
    setup_logging(service, cfg.logging.level, cfg.logging.json_format)
    return cfg


def print_section(section: BaseModel) -> None:
    typer.echo(yaml.safe_dump(section.model_dump(mode="json"), sort_keys=False).rstrip())


def add_show_config(app: typer.Typer, cls: type[ServiceSettings], section: str) -> None:
    """Register `show-config` on a service's app: its effective section as YAML."""

    def show_config(config: ConfigOption = None) -> None:
        print_section(getattr(load_or_exit(cls, config), section))

    show_config.__doc__ = f"Print the effective {section} section (file + environment + defaults)."
    app.command("show-config")(show_config)
