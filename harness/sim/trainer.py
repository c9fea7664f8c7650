"""A trainer backend that sleeps instead of computing: the real training loop and GRPO core
(`trainer.loop`, `trainer.step`: advantages, packing, the loss math) over a simulated GPU.

Named by dotted path in the trainer's config (`trainer.backend:
harness.sim.trainer:load_sleeping_backend`); product code never imports it. Its cost model
comes from the environment variable `SEARCHR1_SIM_TRAINER` (JSON, read when the loader runs):

- `tokens_per_s_per_gpu`: a whole GRPO step's rate (old and reference logprobs, forward,
  backward, optimizer) per trainer GPU; default 6,879, the Megatron backend's measured rate
  for Qwen2.5-3B at slime's batch on one H100 (docs/benchmarks.md, "Trainer on a GPU");
- `gpus`: trainer GPUs (data parallel, assumed to scale linearly);
- `time_scale`: simulated seconds per real second (the bench runs faster than a cluster);
- `token_unit`: real tokens one generated id stands for (`harness.sim.cost`).

A step lasts `tokens / (tokens_per_s_per_gpu * gpus) / time_scale` from its first logprobs
call to the end of its `forward_backward`, where `tokens` are the packed micro-batches' real
tokens (prompt and response, as the measured rate counts them): the GRPO core's own CPU work in
between (packing, advantages, the loss math) is part of that time, as it is part of the
measured rate, and only the rest is slept. Logprobs are zeros (the loss runs on them for
real). The weights are one tiny tensor, so a weight push is the real sender's protocol at no
transfer cost: the simulated engine charges the transfer of the model's real size
(`harness.sim.engine`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from harness.sim.cost import MEASURED_TOKENS_PER_S
from trainer.backend import LossFn, OptimizerStep, Policy, TrainerBackend
from trainer.batching import MicroBatch
from trainer.config import TrainerConfig
from trainer.dist import DistInfo

T = TypeVar("T")
ENV = "SEARCHR1_SIM_TRAINER"


@dataclass(frozen=True)
class TrainerCost:
    tokens_per_s_per_gpu: float = MEASURED_TOKENS_PER_S
    gpus: int = 1
    time_scale: float = 1.0
    token_unit: int = 1

    def step_s(self, tokens: int, generated: int = 0) -> float:
        """Simulated seconds of a step over `tokens` ids, `generated` of them model output
        (each `token_unit` real tokens)."""
        real = tokens + generated * (self.token_unit - 1)
        return real / (self.tokens_per_s_per_gpu * self.gpus)


class SleepingBackend(TrainerBackend):
    def __init__(self, cfg: TrainerConfig, cost: TrainerCost) -> None:
        self.cfg = cfg
        self.cost = cost
        self._steps = 0
        self._lock = threading.Lock()
        self.slept_s = 0.0  # simulated seconds asleep, for the bench's accounting
        self._step_start: float | None = None  # the current step's first logprobs call

    def logprobs(self, microbatches: Sequence[MicroBatch], policy: Policy) -> list[torch.Tensor]:
        if self._step_start is None:
            self._step_start = time.perf_counter()
        return [torch.zeros(mb.targets.numel()) for mb in microbatches]

    def forward_backward(
        self, microbatches: Sequence[MicroBatch], loss_fn: LossFn, *, entropy_grad: bool
    ) -> None:
        start = self._step_start if self._step_start is not None else time.perf_counter()
        self._step_start = None
        tokens = generated = 0
        for mb in microbatches:
            logp = torch.zeros(mb.targets.numel(), requires_grad=True)
            entropy = torch.zeros(mb.targets.numel()) if entropy_grad else None
            loss_fn(mb, logp, entropy).loss.backward()
            tokens += mb.num_tokens
            generated += mb.targets.numel()
        # The real CPU spent since the step began is part of it: sleep the rest.
        sim_s = self.cost.step_s(tokens, generated)
        real_s = sim_s / self.cost.time_scale - (time.perf_counter() - start)
        if real_s > 0:
            time.sleep(real_s)
        with self._lock:
            self.slept_s += sim_s

    def optimizer_step(self) -> OptimizerStep:
        self._steps += 1
        return OptimizerStep(grad_norm=0.0, lr=self.cfg.optim.lr)

    def scheduler_step(self) -> None:
        pass

    def all_reduce_dp(self, values: dict[str, float]) -> dict[str, float]:
        return dict(values)

    def all_gather_dp(self, obj: T) -> list[T]:
        return [obj]

    def full_state(self) -> dict[str, Any]:
        return {"steps": self._steps}

    def load_full_state(self, state: dict[str, Any] | None) -> None:
        self._steps = int((state or {}).get("steps", 0))

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "sim.weight", torch.zeros(1)

    def export_hf(self, out_dir: Path) -> Path | None:
        return None

    @property
    def optimizer_steps(self) -> int:
        return self._steps


def cost_from_env() -> TrainerCost:
    raw = os.environ.get(ENV)
    return TrainerCost(**json.loads(raw)) if raw else TrainerCost()


def load_sleeping_backend(cfg: TrainerConfig, info: DistInfo) -> TrainerBackend:
    """The loader `trainer.backend` names: `harness.sim.trainer:load_sleeping_backend`."""
    return SleepingBackend(cfg, cost_from_env())
