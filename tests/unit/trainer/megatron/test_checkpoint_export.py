"""A Megatron checkpoint (TP=2 x DP=... on gloo) exports as a plain HF directory in one process
(`searchr1 trainer export-hf CKPT OUT`), equal to the trained weights, with the tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("megatron.core")

from tests.support.torchrun import torchrun, torchrun_env

HERE = Path(__file__).parent


@pytest.mark.slow
def test_megatron_checkpoint_exports_in_one_process(tmp_path, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    section = {
        "backend": "megatron",
        "megatron": {"tp": 2},
        "model": {"path": str(tiny_model_dir)},
        "optim": {"lr": 1e-2},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
    }
    stack = tmp_path / "stack.yaml"
    stack.write_text(yaml.safe_dump({"trainer": section}))
    env = torchrun_env()
    direct = tmp_path / "direct"
    train = torchrun(2, str(HERE / "ckpt_worker.py"), str(stack), str(direct))
    proc = subprocess.run(train, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    # Its own process: the Megatron CPU shims must not reach the pytest process.
    out = tmp_path / "hf"
    export = [
        sys.executable,
        "-m",
        "stack.cli",
        "trainer",
        "export-hf",
        str(tmp_path / "ckpt"),
        str(out),
        "--config",
        str(stack),
    ]
    proc = subprocess.run(export, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)  # the tokenizer travels with the weights
    trained = AutoModelForCausalLM.from_pretrained(direct)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[1, 5, 9, 14]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trained(ids).logits)
        assert not torch.allclose(base(ids).logits, loaded(ids).logits, atol=1e-4)
