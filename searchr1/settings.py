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
from typing import Any, NamedTuple, TypeVar

import yaml
from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from searchr1.sections import BusConfig, LoggingConfig, Placement, RedisConfig, RunConfig

ENV_PREFIX = "SEARCHR1_"
# Keys that hold secrets: allowed from the environment only, never from a config file.
SECRET_KEYS = {"admin_token"}


class ConfigError(ValueError):
    """An invalid configuration; the message names every offending field."""


class Follows(NamedTuple):
    """A setting that follows from the placement: filled in where the file leaves it out; named
    with another value, the configuration is refused (it would contradict the placement)."""

    path: tuple[str, ...]
    value: Any
    why: str


# What each placement sets, in every service that has the section (a service loads only its
# own: the trainer's settings get the trainer's part). docs/deploy.md, "Placement".
PLACEMENT_SETS: dict[Placement, tuple[Follows, ...]] = {
    Placement.COLOCATED: (
        Follows(
            ("orchestrator", "mode"),
            "sync",
            "async would generate while the trainer holds the devices; its engines are "
            "released then",
        ),
        Follows(
            ("trainer", "weight_push", "mode"), "handover", "weights from the trainer's memory"
        ),
        Follows(
            ("trainer", "weight_push", "release_engines_while_training"),
            True,
            "the engines give the trainer their memory while it trains",
        ),
    ),
    Placement.DISAGGREGATED: (
        Follows(
            ("trainer", "weight_push", "release_engines_while_training"),
            False,
            "engines on separate devices have no memory to give the trainer",
        ),
    ),
}


def _plain(node: Any) -> Any:
    """A section as the dict it was given as (a model: the fields that were set)."""
    return node.model_dump(exclude_unset=True) if isinstance(node, BaseModel) else node


def given_value(data: dict[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    """(True, value) when the input names the field at `path`, else (False, None)."""
    node: Any = data
    for key in path:
        node = _plain(node)
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def with_value(data: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A copy of the input with `value` at `path` (the dicts on the way copied, never mutated)."""
    out = dict(data)
    node = out
    for key in path[:-1]:
        child = _plain(node.get(key))
        if child is None:
            child = {}
        if not isinstance(child, dict):
            return out  # not a section: its own validation reports it
        node[key] = child = dict(child)
        node = child
    node[path[-1]] = value
    return out


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _same(given: Any, value: Any) -> bool:
    try:  # as the field would read it: "true" from the environment is True
        return TypeAdapter(type(value)).validate_python(given, strict=False) == value
    except ValidationError:
        return False


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
    placement: Placement = Field(
        default=Placement.DISAGGREGATED,
        description="colocated: engines and trainer share devices and alternate; it sets "
        "orchestrator.mode sync, trainer.weight_push.mode handover and "
        "release_engines_while_training true (searchr1.settings.PLACEMENT_SETS: a field named "
        "with another value is refused); docs/deploy.md.",
    )
    logging: LoggingConfig = LoggingConfig()
    redis: RedisConfig = RedisConfig()
    bus: BusConfig = BusConfig()
    # Shared token for state-changing endpoints (weight updates, cache flush, admin).
    admin_token: SecretStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _follow_placement(cls, data: Any) -> Any:
        """Fill in what the placement sets; refuse a named field that contradicts it."""
        if not isinstance(data, dict):
            return data
        try:
            placement = Placement(data.get("placement", Placement.DISAGGREGATED))
        except ValueError:
            return data  # the field's own validation names it
        for need in PLACEMENT_SETS[placement]:
            if need.path[0] not in cls.model_fields:
                continue  # another service's section
            named, value = given_value(data, need.path)
            if not named:
                data = with_value(data, need.path, need.value)
            elif not _same(value, need.value):
                field = ".".join(need.path)
                raise ValueError(
                    f"placement {placement.value} sets {field}: {_shown(need.value)} "
                    f"({need.why}), but the configuration names {field}: {_shown(value)}; "
                    "leave it out (it follows from placement) or change placement"
                )
        return data

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
