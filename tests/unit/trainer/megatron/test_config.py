"""`trainer.backend` / `trainer.megatron`: parsed, and layouts the model cannot take refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainer.backends.megatron.config import MegatronConfig, check_layout
from trainer.config import TrainerConfig


def test_section_parses_and_defaults() -> None:
    cfg = TrainerConfig(backend="megatron", megatron={"tp": 2, "pp": 2})
    assert cfg.backend == "megatron" and cfg.megatron.distributed_optimizer
    assert TrainerConfig().backend == "hf"
    with pytest.raises(ValidationError):
        TrainerConfig(megatron={"tp": 0})
    with pytest.raises(ValidationError):
        TrainerConfig(megatron={"sp": 2})  # unknown keys are errors
    with pytest.raises(ValidationError):
        TrainerConfig(backend="deepspeed")


def test_layout_checks() -> None:
    shape = {"heads": 16, "kv_heads": 2, "layers": 36}  # Qwen2.5-3B
    assert check_layout(MegatronConfig(tp=2), 8, **shape) == 4
    assert check_layout(MegatronConfig(tp=2, pp=2), 4, **shape) == 1
    with pytest.raises(ValueError, match="world size 6"):
        check_layout(MegatronConfig(tp=4), 6, **shape)
    with pytest.raises(ValueError, match="key/value heads"):
        check_layout(MegatronConfig(tp=4), 4, **shape)
    with pytest.raises(ValueError, match="layers"):
        check_layout(MegatronConfig(pp=5), 5, **shape)
