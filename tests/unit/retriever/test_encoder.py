from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from retriever.backends.base import BackendUnavailable
from retriever.encoder import DEFAULT_ENCODER, Encoder, EncoderProcess, EncoderSpec

SPEC = EncoderSpec(model_path=DEFAULT_ENCODER, max_length=32)
TEXTS = ["who founded rome", "a much longer question about the history of the harbor", "x"]


@pytest.fixture(scope="module")
def local():
    return Encoder(SPEC, device="cpu")


def test_vectors_are_unit_norm_and_order_independent(local):
    v = local.encode(TEXTS, is_query=True, batch_size=2)
    assert v.shape == (3, 384) and v.dtype == np.float32
    assert np.linalg.norm(v, axis=1) == pytest.approx([1, 1, 1], abs=1e-5)
    # Sorted by length inside; each row still belongs to its text.
    alone = local.encode([TEXTS[1]], is_query=True)
    assert v[1] == pytest.approx(alone[0], abs=1e-5)
    # The prefix matters: "query: " vs "passage: ".
    assert not np.allclose(v[0], local.encode([TEXTS[0]], is_query=False)[0], atol=1e-3)


def test_encoder_process_matches_in_process_and_reports_death(local):
    proc = EncoderProcess(SPEC, device="cpu")
    try:
        assert proc.dim == 384 and proc.alive()
        got = proc.encode(TEXTS, is_query=True)
        assert got == pytest.approx(local.encode(TEXTS, is_query=True), abs=1e-5)
        os.kill(proc.pid, signal.SIGKILL)
        proc._proc.join(10)
        assert not proc.alive()
        with pytest.raises(BackendUnavailable, match="encoder process died"):
            proc.encode(["q"], is_query=True)
    finally:
        proc.close()


def test_encoder_process_start_failure_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        EncoderProcess(EncoderSpec(model_path=str(tmp_path / "nope")), device="cpu")


def test_a_script_that_never_closes_the_encoder_process_still_exits() -> None:
    # The child ignores SIGTERM (the parent decides when it stops); multiprocessing's exit
    # handler terminates daemonic children with SIGTERM and then waits for them: forever.
    import subprocess
    import sys

    code = (
        "from retriever.encoder import DEFAULT_ENCODER, EncoderProcess, EncoderSpec\n"
        "p = EncoderProcess(EncoderSpec(model_path=DEFAULT_ENCODER, max_length=8), device='cpu')\n"
        "print(p.encode(['q'], is_query=True).shape)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env
    )
    assert out.returncode == 0 and "(1, 384)" in out.stdout, out.stderr[-2000:]
