"""Config validation and CLI errors name the offending field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from stack.cli import app
from trainer.backends.registry import BACKENDS
from trainer.config import TrainerConfig
from trainer.wiring import backend_loader


def test_tis_needs_recomputed_old_logprobs() -> None:
    with pytest.raises(ValidationError, match=r"tis\.mode needs loss\.old_logprobs=recompute"):
        TrainerConfig(tis={"mode": "token"}, loss={"old_logprobs": "rollout"})
    TrainerConfig(tis={"mode": "mis"})  # the default recompute is fine


def test_unknown_keys_are_errors() -> None:
    with pytest.raises(ValidationError, match="kl_coeff"):
        TrainerConfig(loss={"kl_coeff": 0.1})


def test_run_without_model_names_the_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("redis: {url: 'redis://127.0.0.1:1/0'}\n")
    result = CliRunner().invoke(app, ["trainer", "run", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "trainer.model.path" in result.output


def test_bad_section_value_names_the_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer: {loss: {eps_clip_high: -1}}\n")
    result = CliRunner().invoke(app, ["trainer", "show-config", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "trainer.loss.eps_clip_high" in result.output


def test_unknown_backend_names_the_field_and_the_choices(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer: {backend: deepspeed}\n")
    result = CliRunner().invoke(app, ["trainer", "show-config", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "trainer.backend" in result.output
    assert all(name in result.output for name in BACKENDS)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_registered_backend_names_a_loader(name: str) -> None:
    if name == "megatron":
        pytest.importorskip("megatron.core")
    assert callable(backend_loader(name))
