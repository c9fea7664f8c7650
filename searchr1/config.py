"""Configuration: one YAML file format with a section per component, env-var overrides.

Every component declares its own pydantic model (in its package's `config.py`) and receives only
that section. `StackConfig` composes them so that one file drives `searchr1 local`, compose and
the Helm chart alike. Precedence: environment (`SEARCHR1_<SECTION>__<FIELD>`, nested with `__`)
> YAML file > defaults. Secrets (tokens, API keys) are read from the environment only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from inference.config import InferenceConfig
from orchestrator.config import OrchestratorConfig
from retriever.config import RetrieverConfig
from searchr1.local.config import LocalConfig
from searchr1.sections import BusConfig, LoggingConfig, RedisConfig
from trainer.config import TrainerConfig

ENV_PREFIX = "SEARCHR1_"


class ConfigError(ValueError):
    """An invalid configuration; the message names every offending field."""


class StackConfig(BaseSettings):
    """The whole stack's configuration: one section per component."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    logging: LoggingConfig = LoggingConfig()
    redis: RedisConfig = RedisConfig()
    bus: BusConfig = BusConfig()
    retriever: RetrieverConfig = RetrieverConfig()
    inference: InferenceConfig = InferenceConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: TrainerConfig = TrainerConfig()
    local: LocalConfig = LocalConfig()
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

    @model_validator(mode="after")
    def _sync_mode_batches_match(self) -> StackConfig:
        # In sync mode the orchestrator publishes one step's groups, then waits for the
        # version the trainer pushes after consuming exactly that many groups: unequal sizes
        # would make the two wait on each other forever.
        orch, trainer = self.orchestrator, self.trainer
        if orch.mode == "sync" and orch.rollout.prompts_per_step != trainer.batch.groups_per_step:
            raise ValueError(
                "orchestrator.rollout.prompts_per_step "
                f"({orch.rollout.prompts_per_step}) must equal trainer.batch.groups_per_step "
                f"({trainer.batch.groups_per_step}) in sync mode"
            )
        return self

    @model_validator(mode="after")
    def _backlog_holds_the_unacked_window(self) -> StackConfig:
        # The trainer acknowledges trajectories only once a checkpoint holds them, so up to
        # `checkpoint.every_steps` trained steps stay unacked while it gathers the next one. The
        # bus blocks publishing at `max_backlog` unacked entries: a smaller bound starves the
        # trainer of its next step and both wait forever.
        trainer = self.trainer
        held = trainer.checkpoint.every_steps if trainer.checkpoint.dir else 0
        per_step = trainer.batch.groups_per_step * self.orchestrator.rollout.group_size
        need = (held + 1) * per_step
        if self.bus.max_backlog < need:
            raise ValueError(
                f"bus.max_backlog ({self.bus.max_backlog}) must be at least {need}: "
                f"(trainer.checkpoint.every_steps {held} + 1) x trainer.batch.groups_per_step "
                f"{trainer.batch.groups_per_step} x orchestrator.rollout.group_size "
                f"{self.orchestrator.rollout.group_size}, the trajectories the trainer holds "
                "unacknowledged until its next checkpoint plus one step"
            )
        return self

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


# Keys that hold secrets: allowed from the environment only, never from a config file.
SECRET_KEYS = {"admin_token"}


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


def load_config(path: str | Path | None = None, **overrides: Any) -> StackConfig:
    """Load the stack config from an optional YAML file plus the environment.

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
        return StackConfig(**data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None
