"""The varlen attention refuses models whose attention it would silently get wrong (sliding
windows, logit softcapping, attention sinks), unless another attn_implementation is chosen."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.unit.trainer.conftest import tiny_qwen2
from trainer.attention import varlen_causal_attention
from trainer.backends.hf import HFBackend
from trainer.config import ModelConfig, TrainerConfig
from trainer.dist import DistInfo

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}


def _sliding_qwen2(max_window_layers: int = 0) -> nn.Module:
    # Qwen2 slides only in the layers from max_window_layers on.
    return tiny_qwen2(
        use_sliding_window=True, sliding_window=16, max_window_layers=max_window_layers
    )


def test_sliding_window_is_refused_with_varlen() -> None:
    with pytest.raises(ValueError, match=r"sliding_window=16.*use_sliding_window"):
        HFBackend(_sliding_qwen2(), TrainerConfig(), CPU)


def test_another_attn_implementation_is_allowed() -> None:
    cfg = TrainerConfig(model=ModelConfig(attn_implementation="sdpa"))
    HFBackend(_sliding_qwen2(), cfg, CPU)


def test_use_sliding_window_without_sliding_layers_is_accepted() -> None:
    HFBackend(_sliding_qwen2(max_window_layers=2), TrainerConfig(), CPU)


def test_softcapping_is_refused() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(**SMALL))
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50"):
        HFBackend(model, TrainerConfig(), CPU)


def test_attention_sinks_are_refused() -> None:
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(**{**SMALL, "intermediate_size": 32}, num_local_experts=2)
    with pytest.raises(ValueError, match=r"sinks"):
        HFBackend(GptOssForCausalLM(cfg), TrainerConfig(), CPU)


@pytest.mark.parametrize("kw", [{"sliding_window": 4}, {"softcap": 30.0}, {"s_aux": torch.ones(2)}])
def test_the_attention_function_refuses_what_it_would_ignore(kw: dict[str, object]) -> None:
    # A model whose config names these differently still passes them at call time.
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=next(iter(kw))):
        varlen_causal_attention(nn.Module(), q, q, q, None, **kw)  # type: ignore[arg-type]


def test_loading_a_softcapped_model_names_the_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # transformers refuses sdpa for Gemma2 itself: the placeholder used while loading must not
    # hide the varlen refusal behind that error.
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from trainer.backends.hf import load_hf_model

    Gemma2ForCausalLM(Gemma2Config(**SMALL)).save_pretrained(tmp_path)
    cfg = TrainerConfig(model=ModelConfig(path=str(tmp_path)))
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50"):
        HFBackend(load_hf_model(cfg), cfg, CPU)


def test_cuda_attention_stays_off_the_per_shape_cudnn_kernel() -> None:
    """On CUDA the per-sequence attention keeps PyTorch off cuDNN attention, which plans per
    shape: on an H100 every new sequence length cost ~25 ms (a Qwen2.5-3B step 80-84 s, not
    36-39 s). The backend flags are global, so this holds on a machine without a GPU too."""
    from trainer.attention import shape_free_sdpa

    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    with shape_free_sdpa(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()  # fp32 has no flash kernel
    assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before
    with shape_free_sdpa(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before


# -- one varlen call per layer (the CUDA kernel's arguments, checked on CPU) ----------------


class _RecordingKernel:
    """Stands in for PyTorch's FlashAttention varlen kernel, which needs a GPU: records each
    call's arguments and answers with the per-sequence fallback (what the kernel computes)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []
        self.bounds: list[torch.Tensor] = []  # the device bounds of each call (kept alive)
        self.dtypes: set[tuple[torch.dtype, ...]] = set()

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):  # type: ignore[no-untyped-def]
        import trainer.attention as attention

        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
        assert window_size == (-1, 0) and enable_gqa == (q.shape[1] != k.shape[1])
        self.calls.append({"tokens": q.shape[0], "sequences": cu_q.numel() - 1, "max": max_q})
        self.bounds.append(cu_q)
        self.dtypes.add((q.dtype, k.dtype, v.dtype))
        return attention.per_sequence_attention(q, k, v, cu_q.to(torch.int64), scale=scale)


@pytest.fixture
def recording_kernel(monkeypatch: pytest.MonkeyPatch) -> _RecordingKernel:
    import trainer.attention as attention

    kernel = _RecordingKernel()
    monkeypatch.setattr(attention, "flash_varlen_applies", lambda q, dropout: True)
    monkeypatch.setattr(
        attention, "_flash_varlen", lambda: (kernel, {"window_size": (-1, 0)}, True)
    )
    return kernel


def _packed_batch():  # type: ignore[no-untyped-def]
    from tests.unit.trainer.conftest import make_trajectory
    from trainer.batching import build_microbatch, sequence_from_trajectory

    trajs = [
        make_trajectory(f"t{i}", "g", 1.0, prompt_len=3 + i, response_len=4 + 2 * i, seed=i)
        for i in range(3)
    ]
    seqs = [sequence_from_trajectory(t)[0] for t in trajs]
    return build_microbatch(seqs, [0, 1, 2], packed=True)


def test_hf_packed_row_is_one_kernel_call_per_layer(recording_kernel: _RecordingKernel) -> None:
    mb = _packed_batch()
    fallback = HFBackend(tiny_qwen2(), TrainerConfig(), CPU)
    expected = fallback.logprobs([mb], policy=fallback_policy())
    recording_kernel.calls.clear()
    recording_kernel.bounds.clear()
    backend = HFBackend(tiny_qwen2(), TrainerConfig(), CPU)
    got = backend.logprobs([mb], policy=fallback_policy())
    layers = backend.model.config.num_hidden_layers
    assert len(recording_kernel.calls) == layers
    assert recording_kernel.calls[0] == {
        "tokens": mb.input_ids.shape[1],
        "sequences": 3,
        "max": int((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).max()),  # type: ignore[index]
    }
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=0)
    # One device copy of the bounds for the whole forward, not one per layer.
    assert all(b is recording_kernel.bounds[0] for b in recording_kernel.bounds)


def test_hf_under_autocast_reaches_the_kernel_in_the_compute_dtype(
    recording_kernel: _RecordingKernel,
) -> None:
    """Under bf16 autocast (the HF backend on a GPU) the rotary embedding, computed from the
    fp32 residual stream, turned the bf16 q and k into fp32 while v stayed bf16: the one-call
    kernel refuses fp32, so every HF layer fell back to one attention call per sequence."""
    from trainer.losses import LossTerms

    mb = _packed_batch()
    cfg = TrainerConfig(model=ModelConfig(dtype="bfloat16"))
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    backend.logprobs([mb], policy=fallback_policy())
    backend.forward_backward(
        [mb], lambda m, lp, ent: LossTerms(loss=lp.sum(), metrics={}), entropy_grad=False
    )
    assert recording_kernel.dtypes == {(torch.bfloat16,) * 3}


def fallback_policy():  # type: ignore[no-untyped-def]
    from trainer.backend import Policy

    return Policy.CURRENT


def test_megatron_rows_are_one_kernel_call(recording_kernel: _RecordingKernel) -> None:
    """Megatron's `[s, b, h, d]` rows go to the kernel as one packed row of all their
    segments, grouped KV heads unexpanded; the result equals the per-sequence fallback."""
    pytest.importorskip("megatron.core")
    from trainer.attention import per_sequence_attention

    torch.manual_seed(0)
    s, b, h, hkv, d = 7, 2, 4, 2, 8
    q, k, v = torch.randn(s, b, h, d), torch.randn(s, b, hkv, d), torch.randn(s, b, hkv, d)
    lengths = torch.tensor([[3, 4, 0], [2, 2, 3]])
    out = _segment_attention(q, k, v, lengths)
    assert recording_kernel.calls == [{"tokens": 14, "sequences": 5, "max": 4}]
    rows = []
    for row in range(b):
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[row].cumsum(0)])
        rows.append(
            per_sequence_attention(q[:, row], k[:, row], v[:, row], bounds, scale=None).reshape(
                s, h * d
            )
        )
    torch.testing.assert_close(out, torch.stack(rows, dim=1))


def test_megatron_layers_share_one_copy_of_the_bounds(recording_kernel: _RecordingKernel) -> None:
    """Megatron hands every layer the same `segment_lengths`: the bounds are built and copied
    to the device once per forward (a new forward's lengths get their own)."""
    pytest.importorskip("megatron.core")
    q, k, v = torch.randn(7, 2, 4, 8), torch.randn(7, 2, 2, 8), torch.randn(7, 2, 2, 8)
    lengths = torch.tensor([[3, 4, 0], [2, 2, 3]])
    first = _segment_attention(q, k, v, lengths)
    again = _segment_attention(q, k, v, lengths)  # the next layer
    b0, b1 = recording_kernel.bounds
    assert b1 is b0
    torch.testing.assert_close(again, first)
    other = torch.tensor([[7, 0, 0], [1, 6, 0]])
    _segment_attention(q, k, v, other)  # the next forward
    assert recording_kernel.bounds[2] is not b0
    assert recording_kernel.bounds[2].tolist() == [0, 7, 8, 14]
    with pytest.raises(AssertionError, match="sum to"):
        _segment_attention(q, k, v, torch.tensor([[3, 3, 0], [2, 2, 3]]))


def _segment_attention(q, k, v, lengths):  # type: ignore[no-untyped-def]
    from trainer.backends.megatron.attention import SegmentAttention

    layer = SegmentAttention.__new__(SegmentAttention)
    nn.Module.__init__(layer)
    layer.attention_dropout = nn.Dropout(0.0)
    layer.softmax_scale = None
    return layer.forward(q, k, v, lengths)


def test_recompute_attention_needs_varlen_on_hf() -> None:
    cfg = TrainerConfig(model=ModelConfig(attn_implementation="sdpa", recompute="attention"))
    with pytest.raises(ValueError, match="recompute=attention needs"):
        HFBackend(tiny_qwen2(), cfg, CPU)


def test_the_old_gradient_checkpointing_key_names_its_replacement() -> None:
    with pytest.raises(ValueError, match="recompute: full"):
        TrainerConfig(model={"gradient_checkpointing": True})


def test_hf_recompute_modes_give_the_same_gradients() -> None:
    """`model.recompute` attention (a checkpoint around the varlen attention) and full (HF's
    gradient checkpointing) recompute what `none` keeps: the gradients are bit-identical."""
    from trainer.losses import LossTerms

    mb = _packed_batch()
    grads = []
    for mode in ("none", "attention", "full"):
        backend = HFBackend(tiny_qwen2(), TrainerConfig(model=ModelConfig(recompute=mode)), CPU)
        backend.forward_backward(
            [mb], lambda mb, lp, ent: LossTerms(loss=lp.sum() + ent.sum(), metrics={}),
            entropy_grad=True,
        )  # fmt: skip
        grads.append({n: p.grad.clone() for n, p in backend.model.named_parameters()})
    for name, g in grads[0].items():
        assert g.abs().max() > 0, name
        for other in grads[1:]:
            assert torch.equal(g, other[name]), name
