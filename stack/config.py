"""The whole stack's configuration: every section of the one YAML file, checked together.

Services load only their own section plus the shared ones (`searchr1.settings`); this class
composes them all so that one file drives `searchr1 local`, compose and the Helm chart alike,
and `searchr1 config validate` refuses a file with a typo in any section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from gateway.config import GatewaySettings
from inference.config import InferenceSettings
from orchestrator.config import OrchestratorSettings
from retriever.config import RetrieverSettings
from searchr1.sections import Placement, Section
from searchr1.settings import (
    ENV_PREFIX,
    SECRET_KEYS,
    ConfigError,
    format_validation_error,
    load_settings,
    read_yaml,
)
from searchr1.supervisor import RestartPolicy
from trainer.config import TrainerSettings

__all__ = [
    "ENV_PREFIX",
    "SECRET_KEYS",
    "ConfigError",
    "LocalConfig",
    "Placement",
    "StackConfig",
    "format_validation_error",
    "load_config",
    "read_yaml",
]


class LocalConfig(Section):
    """The `local` section: how `searchr1 local` runs the stack on one machine."""

    log_dir: Path = Field(default=Path("runs/local/logs"), description="One log file per service.")
    redis_dir: Path = Field(
        default=Path("runs/local/redis"), description="Data dir of the embedded Redis (AOF)."
    )
    services: list[str] = Field(
        default=["retriever", "inference", "orchestrator", "trainer"],
        description="Which services to start, in this order.",
    )
    inference_replicas: int = Field(
        default=1,
        ge=1,
        description="Engines to start (inference-0 .. inference-N-1 on inference.http.port + i); "
        "list their URLs in engines.urls.",
    )
    control_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Scale engines during the run: a control endpoint on 127.0.0.1 (token in "
        "<log_dir>/../control.json) for `searchr1 local scale --engines N`. Needs "
        "trainer.weight_push.store_dir (engines join by pulling); turns engines.discover on "
        "for the trainer and orchestrator. None: off; 0: a free port.",
    )
    restart: RestartPolicy = RestartPolicy.NEVER
    max_restarts: int = Field(
        default=3, ge=0, description="Restarts in a row (a child ready 5 minutes starts again)."
    )
    ready_timeout_s: float = Field(default=600.0, gt=0)
    grace_s: float = Field(default=20.0, gt=0, description="SIGTERM -> SIGKILL delay on stop.")


class StackConfig(
    RetrieverSettings, InferenceSettings, OrchestratorSettings, TrainerSettings, GatewaySettings
):
    """Every service's settings at once (each checks its own fields against `run`; what the
    placement and the engines section set is derived in each service's own settings)."""

    model_config = SettingsConfigDict(extra="forbid")

    local: LocalConfig = LocalConfig()

    @model_validator(mode="after")
    def _scaling_needs_the_store(self) -> StackConfig:
        if self.local.control_port is not None and not self.trainer.weight_push.store_dir:
            raise ValueError(
                "local.control_port (scaling engines during the run) needs "
                "trainer.weight_push.store_dir: added engines pull the current weights from it"
            )
        return self


def load_config(path: str | Path | None = None, **overrides: Any) -> StackConfig:
    """Load the stack config from an optional YAML file plus the environment.

    `overrides` (section dicts, e.g. from tests) are merged over the file's values.
    Raises ConfigError naming each invalid field.
    """
    return load_settings(StackConfig, path, **overrides)
