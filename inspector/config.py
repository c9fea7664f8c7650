"""Configuration of the inspector (a small web app over one run directory)."""

from __future__ import annotations

from pydantic import Field

from searchr1.sections import HttpConfig, Section


class InspectorHttpConfig(HttpConfig):
    port: int = Field(default=8200, ge=0, le=65535)


class InspectorConfig(Section):
    http: InspectorHttpConfig = Field(default_factory=InspectorHttpConfig)
    refresh_s: float = Field(
        default=5.0, gt=0, description="The overview re-reads the curves this often (live run)."
    )
    page_size: int = Field(default=500, ge=1, description="Trajectories listed per page.")
    metrics_file: str = Field(  # searchr1.rundir.TRAIN_METRICS, spelled here: configs are leaves
        default="train_metrics.jsonl", description="The trainer's metrics_jsonl, in the run dir."
    )
