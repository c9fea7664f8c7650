"""A user's trainer backend by dotted path (`trainer.backend: pkg.module:loader`), and the
staleness metrics of a step."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from searchr1.settings import ConfigError
from trainer.config import TrainerConfig
from trainer.metrics import staleness_metrics
from trainer.wiring import backend_loader

HERE = __name__


def fake_loader(cfg: Any, info: Any) -> str:
    return "a backend"


def wrong_signature(cfg: Any) -> str:
    return "never called"


NOT_CALLABLE = 3


def test_a_dotted_path_is_accepted_and_loaded() -> None:
    cfg = TrainerConfig(backend=f"{HERE}:fake_loader")
    loader = backend_loader(cfg.backend)
    assert loader(cfg, None) == "a backend"


@pytest.mark.parametrize("name", ["deepspeed", "pkg.module", "pkg.module:", ":fn", "a b:c"])
def test_anything_else_is_refused_by_the_config(name: str) -> None:
    with pytest.raises(ValidationError, match="dotted path"):
        TrainerConfig(backend=name)


@pytest.mark.parametrize(
    "path",
    [f"{HERE}:wrong_signature", f"{HERE}:NOT_CALLABLE", f"{HERE}:missing", "no_such_pkg.mod:fn"],
)
def test_a_bad_loader_is_a_config_error_at_start_up(path: str) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.backend"):
        backend_loader(TrainerConfig(backend=path).backend)


def test_staleness_counts_versions_behind_the_trained_weights() -> None:
    m = staleness_metrics([3, 3, 2, 1], trainer_version=3)
    assert m["staleness/mean"] == pytest.approx(0.75)
    assert m["staleness/max"] == 2.0
    assert (m["staleness/count_0"], m["staleness/count_1"], m["staleness/count_2"]) == (2, 1, 1)
    assert staleness_metrics([], 5) == {}
    assert staleness_metrics([4], 3)["staleness/max"] == 0.0  # generated after a newer push
