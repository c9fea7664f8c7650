"""Checkpoints: resume gives bit-identical next-step parameters; saving is atomic."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from searchr1.bus import Receipt
from tests.unit.trainer.conftest import make_batch, tiny_qwen2
from trainer.backends.hf import HFBackend
from trainer.checkpoint import CheckpointManager, TrainerState
from trainer.config import CheckpointConfig, LossConfig, OptimConfig, TrainerConfig
from trainer.dist import DistInfo
from trainer.step import train_on

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def config(tmp_path) -> TrainerConfig:  # type: ignore[no-untyped-def]
    return TrainerConfig(
        optim=OptimConfig(lr=1e-3, schedule="warmup", warmup_steps=3),
        loss=LossConfig(kl_coef=0.01),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), keep_last=2),
    )


def params(backend: HFBackend) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in backend.model.parameters()])


def test_resume_is_bit_identical(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = config(tmp_path)
    b1, b2, b3 = make_batch(2, 4, seed=1), make_batch(2, 4, seed=2), make_batch(2, 4, seed=3)

    straight = HFBackend(tiny_qwen2(), cfg, CPU)
    for batch in (b1, b2, b3):
        train_on(batch, straight, cfg)

    first = HFBackend(tiny_qwen2(), cfg, CPU)
    train_on(b1, first, cfg)
    train_on(b2, first, cfg)
    mgr = CheckpointManager(cfg.checkpoint)
    receipts = [Receipt("1-0", "g0-s0"), Receipt("1-1", "g0-s1")]
    mgr.save(first, TrainerState(step=2, receipts=receipts, weight_version=2))
    torch.manual_seed(1234)  # the RNG must come back too

    # The reference policy comes from the initial weights (model.path), as in a real restart;
    # the policy's parameters are scrambled so they must come from the checkpoint.
    resumed = HFBackend(tiny_qwen2(), cfg, CPU)
    with torch.no_grad():
        for p in resumed.model.parameters():
            p.add_(torch.randn_like(p))
    state = mgr.load(resumed)
    assert state is not None and state.step == 2 and state.receipts == receipts
    assert state.weight_version == 2
    assert resumed.optimizer_steps == 2
    assert torch.equal(params(resumed), params(first))
    train_on(b3, resumed, cfg)
    assert torch.equal(params(resumed), params(straight))
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()


def test_save_is_atomic_and_prunes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = config(tmp_path)
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    mgr = CheckpointManager(cfg.checkpoint)
    assert mgr.latest() is None
    # Debris of a crash in the middle of a save is ignored, then cleaned up.
    root = tmp_path / "ckpt"
    (root / ".step_00000009.tmp-1").mkdir(parents=True)
    for step in (1, 2, 3):
        mgr.save(backend, TrainerState(step=step))
    assert mgr.latest() == root / "step_00000003"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert json.loads((root / "step_00000003" / "trainer.json").read_text())["step"] == 3
    # A `latest` naming an incomplete directory is not trusted.
    (root / "latest").write_text("step_00000099")
    assert mgr.latest() is None


class Intruder:
    """Unpickling it runs code: here, it touches a file (a real attacker runs anything)."""

    def __init__(self, marker) -> None:  # type: ignore[no-untyped-def]
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def test_a_checkpoint_holding_a_pickled_object_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Write access to the checkpoint volume must not be code execution in the trainer.
    cfg = config(tmp_path)
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    mgr = CheckpointManager(cfg.checkpoint)
    path = mgr.save(backend, TrainerState(step=1))
    assert path is not None
    marker = tmp_path / "owned"
    state = torch.load(path / "state.pt", weights_only=True)
    state["scheduler"]["payload"] = Intruder(marker)
    torch.save(state, path / "state.pt")
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        mgr.load(HFBackend(tiny_qwen2(), cfg, CPU))
    assert not marker.exists()


def test_the_saved_state_is_tensors_and_plain_data_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = config(tmp_path)
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    train_on(make_batch(2, 4, seed=1), backend, cfg)
    path = CheckpointManager(cfg.checkpoint).save(backend, TrainerState(step=1))
    assert path is not None
    torch.load(path / "state.pt", weights_only=True)  # raises on anything else
