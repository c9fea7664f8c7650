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
