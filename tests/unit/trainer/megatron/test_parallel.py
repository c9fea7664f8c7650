"""The Megatron backend equals the HF backend, layout by layout (gloo ranks on CPU).

Each case runs `worker.py` under torchrun: logprobs (current and reference policy) and entropy
of packed (and right-padded) micro-batches mixing temperatures within 1e-5 of the HF model's,
then one GRPO step of the real core (`trainer.step.train_on`) on both backends: the same loss
metrics and grad norm, and the same updated weights after gathering them into HF names (1e-5;
the step moves them by ~1e-3). Megatron's global state and the CPU shims stay in those processes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.torchrun import torchrun, torchrun_env

pytest.importorskip("megatron.core")

WORKER = Path(__file__).with_name("worker.py")


def _run(tmp_path: Path, ranks: int, tp: int, pp: int, tied: bool) -> dict[str, float]:
    out = tmp_path / "diffs.json"
    cmd = torchrun(ranks, str(WORKER), str(tp), str(pp), "1" if tied else "0", str(out))
    proc = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    diffs = json.loads(out.read_text())
    assert diffs["moved"] > 1e-4  # the step really changed the weights
    return diffs


@pytest.mark.parametrize(
    ("ranks", "tp", "pp", "tied"),
    [
        pytest.param(1, 1, 1, False, id="tp1"),
        pytest.param(2, 2, 1, False, id="tp2", marks=pytest.mark.slow),
        pytest.param(2, 1, 2, False, id="pp2", marks=pytest.mark.slow),
        pytest.param(2, 1, 1, True, id="dp2-distopt-tied", marks=pytest.mark.slow),
        pytest.param(4, 2, 2, True, id="tp2-pp2-tied", marks=pytest.mark.slow),
        pytest.param(4, 2, 1, False, id="tp2-dp2", marks=pytest.mark.slow),
    ],
)
def test_megatron_equals_hf_backend(
    tmp_path: Path, ranks: int, tp: int, pp: int, tied: bool
) -> None:
    diffs = _run(tmp_path, ranks, tp, pp, tied)
    assert diffs["gather_initial"] == 0.0, diffs  # a weight push sends the HF weights exactly
    for key in (
        "logprobs_current",
        "logprobs_reference",
        "logprobs_padded",
        "entropy",
        "weights",
        "weights_forward",  # `loss.old_logprobs: forward` against `recompute`
        "metric_forward_loss",
        "metric_forward_logprob_diff/trainer_vs_rollout_abs_mean",
    ):
        assert diffs[key] <= 1e-5, (key, diffs)
    # A fresh backend loading the full state takes the next step bit-identically.
    assert diffs["resume"] == 0.0 and diffs["steps_after_resume"] == 2, diffs
    # One rank: gradient checkpointing (Megatron's recompute) changes no gradient.
    assert diffs.get("recompute_checked") == (1.0 if ranks == 1 else None)
    assert diffs["metric_grad_norm"] <= 1e-5 * max(1.0, diffs["value_grad_norm"]), diffs


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "tp"), [(2, 1), (2, 2)], ids=["dp2", "tp2"])
def test_bf16_step_and_resume(tmp_path: Path, ranks: int, tp: int) -> None:
    cmd = torchrun(ranks, str(WORKER.with_name("bf16_worker.py")), str(tp), str(tmp_path))
    proc = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
