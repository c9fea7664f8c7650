"""`searchr1 trainer export-hf CKPT OUT`: a checkpoint becomes a plain HF directory that loads
back; CKPT is one checkpoint or the checkpoint directory (its latest)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from stack.cli import app
from tests.unit.trainer.conftest import make_batch
from trainer.backends.hf import HFBackend, load_hf_model
from trainer.checkpoint import CheckpointManager, TrainerState
from trainer.config import TrainerConfig
from trainer.dist import DistInfo
from trainer.step import train_on


@pytest.mark.parametrize("which", ["step", "root"])
def test_export_checkpoint(tmp_path, tiny_model_dir, which: str) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    section = {
        "model": {"path": str(tiny_model_dir)},
        "optim": {"lr": 1e-2},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
    }
    cfg = TrainerConfig(**section)
    backend = HFBackend(load_hf_model(cfg), cfg, DistInfo(0, 1, 0, torch.device("cpu")))
    train_on(make_batch(1, 4), backend, cfg)
    saved = CheckpointManager(cfg.checkpoint).save(backend, TrainerState(step=1))
    assert saved is not None
    stack = tmp_path / "stack.yaml"
    stack.write_text(yaml.safe_dump({"trainer": section}))

    out = tmp_path / "hf"
    ckpt = saved if which == "step" else saved.parent
    result = CliRunner().invoke(
        app, ["trainer", "export-hf", str(ckpt), str(out), "-c", str(stack)]
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
    (tmp_path / "c").mkdir()
    result = CliRunner().invoke(
        app, ["trainer", "export-hf", str(tmp_path / "c"), str(tmp_path / "o"), "-c", str(stack)]
    )
    assert result.exit_code == 2
    assert "no checkpoint found" in result.output
    assert not (tmp_path / "o").exists()


def test_export_of_a_sharded_checkpoint_needs_the_megatron_backend(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A Megatron checkpoint (its `shards/`) read with `trainer.backend: hf` is refused by name,
    not failed on missing keys."""
    step = tmp_path / "c" / "step_00000001"
    (step / "shards").mkdir(parents=True)
    (step / "state.pt").write_bytes(b"")
    (step / "trainer.json").write_text("{}")
    stack = tmp_path / "stack.yaml"
    stack.write_text(yaml.safe_dump({"trainer": {"model": {"path": str(tiny_model_dir)}}}))
    result = CliRunner().invoke(
        app, ["trainer", "export-hf", str(step), str(tmp_path / "o"), "-c", str(stack)]
    )
    assert result.exit_code == 2
    assert "trainer.backend: megatron" in result.output


def test_old_export_name_is_gone() -> None:
    result = CliRunner().invoke(app, ["trainer", "export", "--help"])
    assert result.exit_code != 0
