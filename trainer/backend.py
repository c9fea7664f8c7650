"""The boundary between the training loop and a model-parallel backend.

The loop (`trainer.loop`) only sees this interface: it prepares `Sample`s (advantages, old and
reference logprobs, TIS weights) and asks the backend to compute logprobs, take optimizer
steps, give its full state for checkpoints and its named tensors for weight pushes. The Hugging
Face / PyTorch (FSDP2) backend is `trainer.hf_backend.HFBackend`; a Megatron backend can be
added behind the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from trainer.batching import Sample


class LogprobKind(StrEnum):
    OLD = "old"  # the current policy before the update -> Sample.old_logprobs
    REF = "ref"  # the frozen reference policy -> Sample.ref_logprobs


class TrainerBackend(ABC):
    rank: int = 0
    world_size: int = 1
    vocab_size: int | None = None  # token ids at or above it are rejected before the forward

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @abstractmethod
    def compute_logprobs(self, samples: Sequence[Sample], kind: LogprobKind) -> None:
        """Fill `old_logprobs` or `ref_logprobs` of every sample (no gradient)."""

    @abstractmethod
    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One rollout batch: `num_minibatches` optimizer steps; returns aggregated metrics."""

    @abstractmethod
    def full_state(self) -> dict[str, Any]:
        """Model, optimizer and scheduler state, complete on the main rank (collective)."""

    @abstractmethod
    def load_full_state(self, state: dict[str, Any] | None) -> None:
        """Inverse of `full_state`; `state` is only needed on the main rank (collective)."""

    @abstractmethod
    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) parameters with Hugging Face names, for weight pushes (collective;
        only the main rank receives tensors)."""

    @abstractmethod
    def export_hf(self, out_dir: Path) -> Path | None:
        """Write a plain Hugging Face directory (safetensors) on the main rank (collective)."""

    @property
    @abstractmethod
    def optimizer_steps(self) -> int: ...
