"""The whole stack's configuration: every section of the one YAML file, checked together.

Services load only their own section plus the shared ones (`searchr1.settings`); this class
composes them all so that one file drives `searchr1 local`, compose and the Helm chart alike,
and `searchr1 config validate` refuses a file with a typo in any section.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from gateway.config import GatewaySettings
from inference.config import InferenceSettings
from orchestrator.config import Mode, OrchestratorSettings
from retriever.config import RetrieverSettings
from searchr1.sections import Section
from searchr1.settings import (
    ENV_PREFIX,
    SECRET_KEYS,
    ConfigError,
    format_validation_error,
    load_settings,
    read_yaml,
)
from searchr1.supervisor import RestartPolicy
from trainer.config import PushMode, TrainerSettings

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
        "list their URLs in orchestrator.engine_urls and trainer.weight_push.engine_urls.",
    )
    restart: RestartPolicy = RestartPolicy.NEVER
    max_restarts: int = Field(default=3, ge=0)
    ready_timeout_s: float = Field(default=600.0, gt=0)
    grace_s: float = Field(default=20.0, gt=0, description="SIGTERM -> SIGKILL delay on stop.")


class Placement(StrEnum):
    DISAGGREGATED = "disaggregated"  # engines and trainer ranks on separate devices
    # On the same devices, alternating (slime's --colocate, verl's hybrid engine): the engines
    # release their memory while the trainer trains and take its weights from its memory.
    COLOCATED = "colocated"


class StackConfig(
    RetrieverSettings, InferenceSettings, OrchestratorSettings, TrainerSettings, GatewaySettings
):
    """Every service's settings at once (each checks its own fields against `run`)."""

    model_config = SettingsConfigDict(extra="forbid")

    placement: Placement = Field(
        default=Placement.DISAGGREGATED,
        description="colocated: engines and trainer share devices and alternate (sync rollouts, "
        "weights handed over in memory, engines released while training); docs/deploy.md.",
    )
    local: LocalConfig = LocalConfig()

    @model_validator(mode="after")
    def _placement_settings(self) -> StackConfig:
        """The settings a placement needs, named (not filled in: each service reads its own
        section, so the file must say it)."""
        push = self.trainer.weight_push
        if self.placement == Placement.COLOCATED:
            wrong = []
            if self.orchestrator.mode != Mode.SYNC:
                wrong.append(
                    "orchestrator.mode: sync (async would generate while the trainer holds the "
                    "devices; its engines are released then)"
                )
            if push.mode != PushMode.HANDOVER:
                wrong.append("trainer.weight_push.mode: handover (weights from trainer memory)")
            if not push.release_engines_while_training:
                wrong.append("trainer.weight_push.release_engines_while_training: true")
            if wrong:
                raise ValueError("placement colocated needs " + "; ".join(wrong))
        elif push.release_engines_while_training:
            raise ValueError(
                "trainer.weight_push.release_engines_while_training is for placement: colocated "
                "(engines on separate devices have no memory to give the trainer)"
            )
        return self


def load_config(path: str | Path | None = None, **overrides: Any) -> StackConfig:
    """Load the stack config from an optional YAML file plus the environment.

    `overrides` (section dicts, e.g. from tests) are merged over the file's values.
    Raises ConfigError naming each invalid field.
    """
    return load_settings(StackConfig, path, **overrides)
