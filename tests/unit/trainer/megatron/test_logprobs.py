"""Vocab-parallel logprobs and entropy on one rank (no process group): equal to
`log_softmax(logits / T)`, padded vocabulary rows ignored, gradients as autograd's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from trainer.backends.megatron.logprobs import vocab_parallel_logprobs


def test_matches_log_softmax_with_temperature_and_padding() -> None:
    torch.manual_seed(0)
    real, padded = 10, 16
    logits = torch.randn(5, padded, requires_grad=True)
    targets = torch.tensor([0, 3, 9, 2, 7])
    temps = torch.tensor([0.7, 1.0, 1.3, 0.7, 2.0])
    lp, ent = vocab_parallel_logprobs(
        logits, targets, temps, vocab_start=0, vocab_size=real, entropy=True
    )
    ref_logits = (logits[:, :real] / temps[:, None]).detach().requires_grad_(True)
    ref = torch.log_softmax(ref_logits, -1)
    want_lp = ref.gather(-1, targets[:, None])[:, 0]
    want_ent = -(ref.exp() * ref).sum(-1)
    torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=0)
    # Hand check of one token: T = 0.7.
    row = logits[0, :real].detach() / 0.7
    assert abs(float(lp[0].detach()) - float(row[0] - row.exp().sum().log())) < 1e-6
    # Gradients: the padded columns get none; the rest equal autograd through log_softmax.
    (lp.sum() + 0.5 * ent.sum()).backward()
    (want_lp.sum() + 0.5 * want_ent.sum()).backward()
    assert not logits.grad[:, real:].any()
    torch.testing.assert_close(logits.grad[:, :real], ref_logits.grad / temps[:, None])


def test_entropy_without_gradient() -> None:
    logits = torch.randn(3, 8, requires_grad=True)
    lp, ent = vocab_parallel_logprobs(
        logits,
        torch.tensor([1, 2, 3]),
        torch.ones(3),
        vocab_start=0,
        vocab_size=8,
        entropy=True,
        entropy_grad=False,
    )
    assert lp.requires_grad and not ent.requires_grad
