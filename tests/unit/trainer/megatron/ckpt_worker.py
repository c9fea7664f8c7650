"""Run under torchrun by `test_checkpoint_export.py`: the Megatron backend from an HF directory
(`load_megatron_backend`, as `searchr1 trainer run` builds it), one GRPO step, a checkpoint
through the trainer's `CheckpointManager`, and a direct HF export to compare with.

    torchrun --nproc-per-node N ckpt_worker.py STACK.yaml DIRECT_EXPORT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from tests.unit.trainer.conftest import make_batch
from trainer.backends.megatron.backend import load_megatron_backend
from trainer.checkpoint import CheckpointManager, TrainerState
from trainer.config import TrainerConfig
from trainer.dist import DistInfo, close_distributed
from trainer.step import train_on


def main() -> None:
    stack, direct = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = TrainerConfig(**yaml.safe_load(stack.read_text())["trainer"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = load_megatron_backend(cfg, DistInfo(rank, world, rank, torch.device("cpu")))
    # A batch within the tiny tokenizer's vocabulary.
    train_on(make_batch(1, 4), backend, cfg)
    CheckpointManager(cfg.checkpoint).save(backend, TrainerState(step=1))
    backend.export_hf(direct)


if __name__ == "__main__":
    main()
    close_distributed()
