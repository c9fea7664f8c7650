"""The trainer's CUDA paths against their fallbacks, on one GPU (skipped without one): the
FlashAttention varlen kernel against per-sequence attention (values and gradients, bf16, GQA),
and logprobs in chunks against the full logits (bf16 and fp32)."""

from __future__ import annotations

import pytest
import torch

from trainer.attention import flash_varlen_applies, packed_causal_attention, per_sequence_attention
from trainer.logprobs import head_token_stats
from trainer.losses import entropy_from_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _qkv(lengths: list[int], heads: int = 16, kv_heads: int = 2, dim: int = 128):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    n = sum(lengths)
    dev = torch.device("cuda")
    q = torch.randn(n, heads, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, kv_heads, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, kv_heads, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    return q, k, v, bounds


def test_varlen_kernel_equals_per_sequence_attention() -> None:
    q, k, v, bounds = _qkv([1, 700, 33, 1200, 5, 2048])
    assert flash_varlen_applies(q, 0.0), "PyTorch's varlen kernel should serve bf16 on CUDA"
    grad = torch.randn_like(q)
    out = packed_causal_attention(q, k, v, bounds, scale=None)
    out.backward(grad)
    got = [t.grad.clone() for t in (q, k, v)]  # type: ignore[union-attr]
    for t in (q, k, v):
        t.grad = None
    ref = per_sequence_attention(q, k, v, bounds, scale=None)
    ref.backward(grad)
    print(f"varlen vs per-sequence: out {(out - ref).abs().max().item():.2e}")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for g, t in zip(got, (q, k, v), strict=True):
        torch.testing.assert_close(g, t.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_logprobs_equal_the_full_logits_on_cuda(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    n, h, vocab = 3000, 256, 32000
    hidden = torch.randn(n, h, device=dev, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, h, device=dev, dtype=dtype) * 0.05).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device=dev)
    temps = torch.full((n,), 0.9)
    z = (hidden @ weight.T).float() / 0.9
    ref_lp = z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
    ref_ent = entropy_from_logits(z)
    (ref_lp.sum() + ref_ent.sum()).backward()
    ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()  # type: ignore[union-attr]
    hidden.grad = weight.grad = None
    lp, ent = head_token_stats(hidden, weight, targets, temps, chunk=1024, compute_dtype=dtype)
    (lp.sum() + ent.sum()).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    print(f"{dtype}: logprobs {(lp - ref_lp).abs().max().item():.2e}")
    torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=tol)
    torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=tol)
    torch.testing.assert_close(hidden.grad, ref_gh, atol=tol, rtol=tol)
    torch.testing.assert_close(weight.grad, ref_gw, atol=tol, rtol=tol)


def test_hf_backend_in_bf16_takes_the_one_call_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The HF backend on one GPU (fp32 weights under bf16 autocast) reaches the varlen kernel
    in every layer, in training and in the logprob passes (its q and k came out of the rotary
    embedding in fp32, and the per-sequence fallback served every layer)."""
    import trainer.attention as attention
    from tests.unit.trainer.conftest import make_batch, tiny_qwen2
    from trainer.backend import Policy
    from trainer.backends.hf import HFBackend
    from trainer.config import TrainerConfig
    from trainer.dist import DistInfo
    from trainer.losses import LossTerms
    from trainer.step import build_sequences, rank_microbatches

    taken: list[bool] = []
    applies = attention.flash_varlen_applies

    def spy(query: torch.Tensor, dropout: float) -> bool:
        taken.append(applies(query, dropout))
        return taken[-1]

    monkeypatch.setattr(attention, "flash_varlen_applies", spy)
    cfg = TrainerConfig(model={"dtype": "bfloat16", "device": "cuda"})
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    backend = HFBackend(tiny_qwen2(), cfg, info)
    seqs = build_sequences(make_batch(2, 4), cfg)[0]
    mbs = rank_microbatches(seqs, backend, cfg)
    backend.logprobs(mbs, Policy.CURRENT)
    backend.forward_backward(
        mbs, lambda mb, lp, ent: LossTerms(loss=lp.sum(), metrics={}), entropy_grad=False
    )
    assert taken and all(taken), f"{taken.count(False)} of {len(taken)} calls fell back"


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "tp-padded"])
def test_chunked_logprobs_never_wait_on_the_gpu(padded: bool) -> None:
    """The head runs between the decoder's forward and backward: a device-to-host read there
    (it asked the GPU whether the vocabulary had padding rows) drained the queue every
    micro-batch, in the forward and again in the backward."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    n, h, vocab = 2048, 256, 32000
    hidden = torch.randn(n, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    rows = vocab + 128 if padded else vocab
    weight = (torch.randn(rows, h, device=dev, dtype=torch.bfloat16) * 0.05).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device=dev)
    temps = torch.full((n,), 0.9, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, ent = head_token_stats(
            hidden, weight, targets, temps, chunk=512, compute_dtype=torch.bfloat16,
            vocab_size=vocab,
        )  # fmt: skip
        (lp.sum() + ent.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert hidden.grad is not None and weight.grad is not None
