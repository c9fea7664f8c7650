"""The `local` section: how `searchr1 local` runs the stack on one machine."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from searchr1.sections import Section
from searchr1.supervisor import RestartPolicy


class LocalConfig(Section):
    log_dir: Path = Field(default=Path("runs/local/logs"), description="One log file per service.")
    redis_dir: Path = Field(
        default=Path("runs/local/redis"), description="Data dir of the embedded Redis (AOF)."
    )
    services: list[str] = Field(
        default=["retriever", "inference", "orchestrator", "trainer"],
        description="Which services to start, in this order.",
    )
    restart: RestartPolicy = RestartPolicy.NEVER
    max_restarts: int = Field(default=3, ge=0)
    ready_timeout_s: float = Field(default=600.0, gt=0)
    grace_s: float = Field(default=20.0, gt=0, description="SIGTERM -> SIGKILL delay on stop.")
