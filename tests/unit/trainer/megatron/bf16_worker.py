"""Run under torchrun by `test_parallel.py`: the Megatron backend in bf16 (CPU bf16 here; the
GPU path is the same code). Logprobs near the fp32 HF model's, one GRPO step, a full state
holding the fp32 main parameters, and a bit-identical resume, from the full state and from a
distributed checkpoint (every DP rank writes its own range of the fp32 main parameters).

    torchrun --nproc-per-node N bf16_worker.py TP CKPT_DIR

The device comes from `SEARCHR1_TEST_DEVICE` (cpu; tests/gpu runs it on CUDA).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from tests.unit.trainer.conftest import make_batch
from tests.unit.trainer.megatron.worker import DEVICE, hf_reference, tiny
from trainer.backend import Policy
from trainer.backends.megatron.backend import MegatronBackend
from trainer.batching import build_microbatch, sequence_from_trajectory
from trainer.checkpoint import CheckpointManager, TrainerState
from trainer.config import TrainerConfig
from trainer.dist import DistInfo, close_distributed
from trainer.step import train_on


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    info = DistInfo(rank, world, rank, DEVICE)
    cfg = TrainerConfig(
        backend="megatron",
        megatron={"tp": int(sys.argv[1])},
        model={"dtype": "bfloat16"},
        optim={"lr": 1e-3},
        loss={"kl_coef": 0.01},
        checkpoint={"dir": sys.argv[2]},
    )

    def build() -> MegatronBackend:
        model = tiny(False)
        return MegatronBackend(dict(model.state_dict()), model.config, cfg, info)

    meg = build()
    assert all(p.dtype == torch.bfloat16 for p in meg.ddp.module.parameters())
    trajs = make_batch(2, 4, seed=1)
    seqs = [sequence_from_trajectory(t)[0] for t in trajs]
    got = meg.logprobs([build_microbatch(seqs, [0, 1, 2], packed=True)], Policy.CURRENT)[0]
    want, _ = hf_reference(tiny(False), seqs)
    diff = float((got.cpu() - torch.cat(want[:3])).abs().max())
    assert diff < 2e-2, diff  # bf16 weights and activations against fp32
    train_on(trajs, meg, cfg)
    state = meg.full_state()
    if rank == 0:
        # fp32 main parameters: not all of them are bf16-representable after an fp32 update.
        w = state["model"]["model.layers.0.mlp.up_proj.weight"]
        assert w.dtype == torch.float32 and not torch.equal(w, w.bfloat16().float())
    again = build()
    again.load_full_state(state if rank == 0 else None)
    mgr = CheckpointManager(cfg.checkpoint)
    mgr.save(meg, TrainerState(step=1))
    sharded = build()
    mgr.load(sharded)
    more = make_batch(2, 4, seed=2)
    for backend in (meg, again, sharded):
        train_on(more, backend, cfg)
    s1, s2, s3 = meg.full_state(), again.full_state(), sharded.full_state()
    if rank == 0:
        assert _equal(s1, s2) and _equal(s1, s3)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


if __name__ == "__main__":
    main()
    close_distributed()
