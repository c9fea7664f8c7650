"""The boundary between the GRPO core and a model-parallel backend: model mechanics only.

The core (`trainer.step`) owns every decision of the algorithm: advantages, which logprobs
are needed, TIS weights, loss weights, mini- and micro-batch plans, the loss itself. A backend
runs forwards and backwards over the core's packed micro-batches (`trainer.batching`), steps
its optimizer and holds the weights. The Hugging Face / PyTorch (FSDP2) backend is
`trainer.backends.hf.HFBackend`; the Megatron-Core one is `trainer.backends.megatron` (chosen
by `trainer.backends.registry`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainer.batching import MicroBatch
from trainer.losses import LossTerms

T = TypeVar("T")


class Policy(StrEnum):
    CURRENT = "current"  # the weights being trained
    REFERENCE = "reference"  # the frozen initial weights (the KL anchor)


@dataclass(frozen=True)
class OptimizerStep:
    grad_norm: float  # global, before clipping
    lr: float  # the LR this update used


# (micro-batch, logprobs [T] fp32 with grad, entropy [T] or None) -> the micro-batch's loss.
LossFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor | None], LossTerms]


class TrainerBackend(ABC):
    rank: int = 0  # global
    world_size: int = 1
    # Data-parallel position: the core gives each DP rank its own micro-batches; every rank of
    # one model-parallel group gets the same ones.
    dp_rank: int = 0
    dp_size: int = 1
    vocab_size: int | None = None  # token ids at or above it are rejected before the forward

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @abstractmethod
    def logprobs(self, microbatches: Sequence[MicroBatch], policy: Policy) -> list[torch.Tensor]:
        """No gradient, eval mode: one fp32 CPU tensor [T] per micro-batch (its response
        tokens, in MicroBatch order), `log_softmax(logits / temperature)[target]`."""

    @abstractmethod
    def forward_backward(
        self, microbatches: Sequence[MicroBatch], loss_fn: LossFn, *, entropy_grad: bool
    ) -> None:
        """Train mode: logprobs (and entropy, with gradient iff `entropy_grad`) of each
        micro-batch -> `loss_fn` -> backward. One call per mini-batch: gradients start from
        zero and accumulate over its micro-batches; then they are the SUM over data-parallel
        ranks of every rank's loss gradients (the core's loss weights already sum to 1 over
        all ranks)."""

    @abstractmethod
    def optimizer_step(self) -> OptimizerStep:
        """Clip to `optim.grad_clip` and step (the gradients stay until the next
        `forward_backward`)."""

    @abstractmethod
    def scheduler_step(self) -> None:
        """Advance the LR schedule: once per training step."""

    @abstractmethod
    def all_reduce_dp(self, values: dict[str, float]) -> dict[str, float]:
        """Sum each value over the data-parallel ranks."""

    @abstractmethod
    def all_gather_dp(self, obj: T) -> list[T]:
        """Every data-parallel rank's `obj`, in rank order."""

    @abstractmethod
    def full_state(self) -> dict[str, Any]:
        """Model, optimizer and scheduler state, complete on the main rank (collective)."""

    @abstractmethod
    def load_full_state(self, state: dict[str, Any] | None) -> None:
        """Inverse of `full_state`; `state` is only needed on the main rank (collective)."""

    # Sharded checkpoints: a backend that sets this writes and reads its own shards on every
    # rank (`save_shards` / `load_shards`) instead of a full state on the main rank.
    sharded_checkpoints: bool = False

    def save_shards(self, directory: Path) -> dict[str, Any]:
        """Collective: every rank writes its shards into `directory` (its parent exists, made
        by the main rank before the call); returns the small rest of the state (plain data)."""
        raise NotImplementedError

    def load_shards(
        self, directory: Path | None, state: dict[str, Any] | None, *, weights_only: bool = False
    ) -> None:
        """Inverse of `save_shards`, at this backend's layout (collective); `directory` and
        `state` are only needed on the main rank. `weights_only`: the weights, not the
        optimizer's state (an export)."""
        raise NotImplementedError

    def offload(self, parts: Sequence[str]) -> int:
        """Colocated placement, between steps: move `parts` (`trainer.offload_between_steps`)
        off the device; returns the bytes moved. Default: nothing (a backend that cannot)."""
        return 0

    def reload(self, parts: Sequence[str]) -> int:
        """Inverse of `offload`, before the next step; returns the bytes moved."""
        return 0

    @abstractmethod
    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) parameters with Hugging Face names and layouts, for weight pushes
        (collective; only the main rank receives tensors)."""

    @abstractmethod
    def export_hf(self, out_dir: Path) -> Path | None:
        """Write a plain Hugging Face directory (safetensors) on the main rank (collective)."""

    @property
    @abstractmethod
    def optimizer_steps(self) -> int: ...
