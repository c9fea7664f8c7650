"""Loading a service's settings: its own sections plus the shared ones, from one YAML file.

The stack has one config file format with a section per component. A service loads only what
it needs: `ServiceSettings` (the shared `run` numbers, logging, Redis, the bus, the admin token)
plus its own section, declared by a subclass in the service's `config.py`; sections of other
services in the same file are skipped. The roof's `StackConfig` (`stack.config`)
composes every section and checks the whole file. Precedence: environment
(`SEARCHR1_<SECTION>__<FIELD>`, nested with `__`) > YAML file > defaults. Secrets (tokens, API
keys) come from the environment only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from searchr1.sections import BusConfig, LoggingConfig, RedisConfig, RunConfig

ENV_PREFIX = "SEARCHR1_"
# Keys that hold secrets: allowed from the environment only, never from a config file.
SECRET_KEYS = {"admin_token"}


class ConfigError(ValueError):
    """An invalid configuration; the message names every offending field."""


class ServiceSettings(BaseSettings):
    """What every service reads: the shared sections. Subclasses add their own section."""

    # Other services' sections in the same file (or environment) are not this service's
    # business: they are skipped here and checked by `searchr1 config validate` / StackConfig.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="ignore",
        validate_assignment=True,
    )

    run: RunConfig = RunConfig()
    logging: LoggingConfig = LoggingConfig()
    redis: RedisConfig = RedisConfig()
    bus: BusConfig = BusConfig()
    # Shared token for state-changing endpoints (weight updates, cache flush, admin).
    admin_token: SecretStr | None = None

    @field_validator("admin_token")
    @classmethod
    def _admin_token_is_usable(cls, token: SecretStr | None) -> SecretStr | None:
        # "" used to switch every guard off (SecretStr("") is falsy); surrounding white space
        # (a secret file written with echo) can never match a header, which HTTP strips.
        if token is None:
            return None
        value = token.get_secret_value()
        if not value.strip():
            raise ValueError("is empty: unset SEARCHR1_ADMIN_TOKEN or give it a value")
        if value != value.strip():
            raise ValueError("has leading or trailing white space (a newline from a file?)")
        return token

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML file arrives as init kwargs; the environment must override it.
        return (env_settings, init_settings)


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        got = e.get("input")
        secret = bool(SECRET_KEYS & {str(p) for p in e["loc"]})  # never echo a secret
        got_txt = "" if isinstance(got, dict) or secret else f" (got {got!r})"
        lines.append(f"  {field}: {e['msg']}{got_txt}")
    return f"invalid configuration in {source}:\n" + "\n".join(lines)


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    leaked = SECRET_KEYS & data.keys()
    if leaked:
        names = ", ".join(f"{ENV_PREFIX}{k.upper()}" for k in sorted(leaked))
        raise ConfigError(
            f"config file {path} sets {', '.join(sorted(leaked))}: secrets come from the "
            f"environment only ({names})"
        )
    return data


S = TypeVar("S", bound=BaseSettings)


def load_settings(cls: type[S], path: str | Path | None = None, **overrides: Any) -> S:
    """Load `cls` from an optional YAML file plus the environment.

    `overrides` (section dicts, e.g. from tests) are merged over the file's values.
    Raises ConfigError naming each invalid field.
    """
    data: dict[str, Any] = read_yaml(Path(path)) if path else {}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    source = str(path) if path else "environment/defaults"
    try:
        return cls(**data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None
