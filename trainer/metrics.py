"""Step metrics: Prometheus (`/metrics`) and a JSON-lines log, one line per step."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

STEPS = Counter("searchr1_trainer_steps_total", "Training steps completed")
TRAJECTORIES = Counter("searchr1_trainer_trajectories_total", "Trajectories trained on")
TOKENS = Counter("searchr1_trainer_tokens_total", "Tokens through forward/backward")
NONFINITE = Counter(
    "searchr1_trainer_nonfinite_logprobs_total",
    "Non-finite logprobs masked out of the loss",
    ["source"],
)
DEGENERATE_GROUPS = Counter(
    "searchr1_trainer_degenerate_groups_total", "Prompt groups whose rewards were all equal"
)
WEIGHT_VERSION = Gauge("searchr1_trainer_weight_version", "Weight version last pushed")
STEP = Gauge("searchr1_trainer_step", "Current training step")
# The last step's value of each named scalar (loss, kl, tis/..., time/...): a fixed, small set.
LAST = Gauge("searchr1_trainer_metric", "Last step's value of a training metric", ["name"])
PUSH_SECONDS = Histogram(
    "searchr1_trainer_weight_push_seconds",
    "Wall time of a weight push to the inference engines",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
CHECKPOINT_SECONDS = Histogram(
    "searchr1_trainer_checkpoint_seconds",
    "Wall time of a checkpoint save",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
ERRORS = Counter("searchr1_trainer_errors_total", "Failures by stage", ["stage"])
# Exported at 0 from start-up: a dashboard's rate() shows 0, not "No data", until a fault.
for _stage in ("train_step", "weight_push", "engine_release", "checkpoint_disk_full"):
    ERRORS.labels(_stage)


def staleness_metrics(weight_versions: list[int], trainer_version: int) -> dict[str, float]:
    """How many versions behind the weights being trained each trajectory was generated:
    `trainer_version` (the steps trained before this one: the version pushed after step k is
    k) minus its oldest turn's version. Sync rollouts give 0; async ones up to max_staleness.
    Mean, max, and a count per value (`staleness/count_<k>`: a histogram, small keys)."""
    if not weight_versions:
        return {}
    lags = [max(trainer_version - v, 0) for v in weight_versions]
    out = {"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags))}
    for lag in sorted(set(lags)):
        out[f"staleness/count_{lag}"] = float(lags.count(lag))
    return out


def record_step(step: int, metrics: dict[str, float]) -> None:
    STEPS.inc()
    STEP.set(step)
    TRAJECTORIES.inc(metrics.get("samples", 0.0))
    TOKENS.inc(metrics.get("train_tokens", 0.0))
    NONFINITE.labels("rollout").inc(metrics.get("nonfinite_rollout_logprobs", 0.0))
    NONFINITE.labels("trainer").inc(metrics.get("nonfinite_trainer_logprobs", 0.0))
    NONFINITE.labels("reference").inc(metrics.get("nonfinite_ref_logprobs", 0.0))
    DEGENERATE_GROUPS.inc(metrics.get("groups/degenerate", 0.0))
    for k, v in metrics.items():
        LAST.labels(k).set(v)


class JsonlLog:
    """Appends one JSON object per step; each line is flushed so a crash loses at most one."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if not self.path:
            return
        line = json.dumps({"ts": round(time.time(), 3), **record}, sort_keys=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()


class OptionalSinks:
    """TensorBoard and/or Weights & Biases, when configured *and* installed (neither is a
    dependency). A configured sink whose package is missing is reported once and skipped."""

    def __init__(self, tensorboard_dir: str | None, wandb_project: str | None) -> None:
        self._tb = None
        self._wandb = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(tensorboard_dir)
            except ImportError as e:
                log.warning("tensorboard sink disabled: package missing", extra={"error": str(e)})
        if wandb_project:
            try:
                import wandb

                wandb.init(project=wandb_project)
                self._wandb = wandb
            except ImportError as e:
                log.warning("wandb sink disabled: package missing", extra={"error": str(e)})

    @property
    def active(self) -> list[str]:
        return [n for n, s in (("tensorboard", self._tb), ("wandb", self._wandb)) if s]

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
