"""The trainer backends on CUDA: the Megatron-vs-HF parity checks of
tests/unit/trainer/megatron on one GPU, in fp32 and in bf16. Skipped without a GPU (CI has
none); docs/benchmarks.md "Trainer on a GPU" has the command and the measured differences.

One GPU allows one rank (NCCL refuses two ranks on one device), so TP = PP = DP = 1 here; the
multi-rank layouts are checked on CPU ranks (gloo) by test_parallel.py.

Tolerances: fp32 as on CPU (1e-5). bf16: both backends compute in bf16 (Megatron with bf16
parameters and fp32 main parameters, HF with fp32 parameters under autocast), so their
logprobs differ by bf16 rounding of the activations; the bounds below are about 4x the
differences measured on an H100 (BF16_TOL; docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.torchrun import torchrun, torchrun_env

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MEGATRON_TESTS = Path(__file__).resolve().parents[1] / "unit" / "trainer" / "megatron"
# bf16: the differences the worker may show (logprobs and entropy in nats, weights after one
# lr=1e-3 step). Measured on an H100 (2026-11-25): logprobs 2.8e-3 / 4.4e-3 (tied / untied),
# entropy 3.6e-4 / 8.8e-5, weights 2.1e-3 (the bf16 rounding of the gathered weights: 2.4e-4
# before the step).
BF16_TOL = {
    "logprobs_current": 2e-2,
    "logprobs_reference": 2e-2,
    "logprobs_padded": 2e-2,
    "entropy": 2e-3,
    "weights": 1e-2,
}


def _worker(tmp_path: Path, dtype: str, tol: float, tied: bool) -> dict[str, float]:
    out = tmp_path / "diffs.json"
    cmd = torchrun(1, str(MEGATRON_TESTS / "worker.py"), "1", "1", "1" if tied else "0", str(out))
    env = {
        **torchrun_env(),
        "SEARCHR1_TEST_DEVICE": "cuda",
        "SEARCHR1_TEST_DTYPE": dtype,
        "SEARCHR1_TEST_TOL": str(tol),
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    diffs = json.loads(out.read_text())
    print(f"{dtype} tied={tied}: {json.dumps(diffs)}")  # the numbers docs/benchmarks.md quotes
    assert diffs["moved"] > 1e-4
    return diffs


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fp32_megatron_equals_hf_on_cuda(tmp_path: Path, tied: bool) -> None:
    diffs = _worker(tmp_path, "float32", 1e-5, tied)
    assert diffs["gather_initial"] == 0.0, diffs
    for key in ("logprobs_current", "logprobs_reference", "logprobs_padded", "entropy", "weights"):
        assert diffs[key] <= 1e-5, (key, diffs)
    assert diffs["resume"] == 0.0, diffs


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bf16_megatron_near_hf_on_cuda(tmp_path: Path, tied: bool) -> None:
    diffs = _worker(tmp_path, "bfloat16", float("inf"), tied)
    for key, bound in BF16_TOL.items():
        assert diffs[key] <= bound, (key, diffs)
    assert diffs["resume"] == 0.0, diffs


def test_bf16_step_and_resume_on_cuda(tmp_path: Path) -> None:
    """bf16 near the fp32 HF model, fp32 main parameters, a bit-identical resume from the full
    state and from a checkpoint (`bf16_worker.py`, as test_parallel.py runs it on CPU)."""
    cmd = torchrun(1, str(MEGATRON_TESTS / "bf16_worker.py"), "1", str(tmp_path))
    env = {**torchrun_env(), "SEARCHR1_TEST_DEVICE": "cuda"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
