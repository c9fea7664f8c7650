"""`searchr1 trainer export`: a checkpoint becomes a plain HF directory that loads back."""

from __future__ import annotations

import torch
import yaml
from typer.testing import CliRunner

from searchr1.stack.cli import app
from tests.unit.trainer.conftest import make_batch
from trainer.checkpoint import CheckpointManager, TrainerState
from trainer.config import TrainerConfig
from trainer.dist import DistInfo
from trainer.hf_backend import HFBackend, load_hf_model
from trainer.step import train_on


def test_export_checkpoint(tmp_path, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    section = {
        "model": {"path": str(tiny_model_dir)},
        "optim": {"lr": 1e-2},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
    }
    cfg = TrainerConfig(**section)
    backend = HFBackend(load_hf_model(cfg), cfg, DistInfo(0, 1, 0, torch.device("cpu")))
    train_on(make_batch(1, 4), backend, cfg)
    CheckpointManager(cfg.checkpoint).save(backend, TrainerState(step=1))
    stack = tmp_path / "stack.yaml"
    stack.write_text(yaml.safe_dump({"trainer": section}))

    out = tmp_path / "hf"
    result = CliRunner().invoke(
        app, ["trainer", "export", "--config", str(stack), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    loaded = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)  # the tokenizer travels with the weights
    ids = torch.tensor([[1, 5, 9, 14]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, backend.model(ids).logits, atol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert not torch.allclose(base(ids).logits, loaded(ids).logits, atol=1e-4)


def test_export_without_checkpoint_fails_clearly(tmp_path, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    stack = tmp_path / "stack.yaml"
    section = {"model": {"path": str(tiny_model_dir)}, "checkpoint": {"dir": str(tmp_path / "c")}}
    stack.write_text(yaml.safe_dump({"trainer": section}))
    result = CliRunner().invoke(
        app, ["trainer", "export", "--config", str(stack), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2
    assert "no checkpoint found" in result.output
