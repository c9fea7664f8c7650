"""Run under torchrun by tests/integration/test_trainer_megatron_push.py: a Megatron trainer
built from an HF directory (`load_megatron_backend`), one GRPO step, a distributed weight push
to the engine in the stack file (`WeightPusher`, the same path as the HF backend's), and an HF
export of the same weights for the HF-backend push to compare with.

    torchrun --nproc-per-node N push_worker.py STACK.yaml EXPORT_DIR
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from tests.unit.trainer.conftest import make_batch
from trainer.backends.megatron.backend import load_megatron_backend
from trainer.config import TrainerConfig
from trainer.dist import DistInfo, close_distributed
from trainer.step import train_on
from trainer.weights import WeightPusher


async def push(backend, cfg: TrainerConfig) -> None:  # type: ignore[no-untyped-def]
    pusher = WeightPusher(cfg.weight_push)
    try:
        res = await pusher.push(backend, step=1)
    finally:
        await pusher.close()
    assert backend.rank != 0 or (res is not None and res.weight_version == 1), res


def main() -> None:
    stack, export = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = TrainerConfig(**yaml.safe_load(stack.read_text())["trainer"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = load_megatron_backend(cfg, DistInfo(rank, world, rank, torch.device("cpu")))
    train_on(make_batch(1, 4), backend, cfg)
    asyncio.run(push(backend, cfg))
    backend.export_hf(export)


if __name__ == "__main__":
    main()
    close_distributed()
