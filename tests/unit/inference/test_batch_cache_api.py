"""The reference engine's forwards use transformers' cache API as it is now: the KV cache goes
in as a `DynamicCache` under the argument's current name, so transformers' "`past_key_values`
... will be removed in version 5.40.0" warning (issue 33) is not raised by a prefill, a decode or
a prefill on top of cached K/V. Any warning from those calls fails here."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from inference.batch import RunningBatch, prefill


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def test_prefill_and_decode_raise_no_warning(model: Any) -> None:
    cpu = torch.device("cpu")
    seqs = [[5, 6, 7, 8], [9, 10]]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")  # the deprecation warning (or any other) fails the test
        logits, kv, pads, used = prefill(model, seqs, pad_id=0, device=cpu)
        batch = RunningBatch(cpu)
        batch.add(["a", "b"], kv, pads)
        step = batch.decode(model, [11, 12])
        # a prefill whose first tokens come from the cache (the prefix cache's path)
        cached = [batch.row_kv(0), None]
        again, kv2, _, used2 = prefill(model, [[5, 6, 7, 8, 11, 13], [9, 10]], 0, cpu, cached)
    assert logits.shape[0] == step.shape[0] == again.shape[0] == 2
    assert used == [0, 0] and used2[0] > 0
    # The cache grew by the decoded column; the cached prefill's K/V span its whole pass.
    assert batch.kv[0][0].shape[2] == kv[0][0].shape[2] + 1
    assert kv2[0][0].shape[2] == 6


def test_the_cached_prefill_matches_a_full_one(model: Any) -> None:
    """The K/V taken from the cache object after the forward are the ones it computed."""
    cpu = torch.device("cpu")
    seq = [5, 6, 7, 8, 11, 13]
    with torch.no_grad():
        full, kv, _, _ = prefill(model, [seq], 0, cpu)
        part, _, _, _ = prefill(model, [seq], 0, cpu, [[(k[0, :, :5], v[0, :, :5]) for k, v in kv]])
    # A prefix of 5 cached tokens (the last is always computed) gives the same logits.
    assert torch.allclose(full, part, atol=1e-5)
