"""Variable-length causal attention for packed micro-batches, on any device.

transformers turns packed `position_ids` into a dense block-diagonal mask for `sdpa`, which
costs O(L^2) over the whole packed row (and loses the fused kernels): packing then runs slower
than padding on CPU. This attention function instead runs `scaled_dot_product_attention` with
`is_causal=True` on each packed sequence (boundaries from `cu_seq_lens_q`, passed by the
backend), costing sum(L_i^2) with the fused kernels. Without boundaries (the padded path, right
padding), one causal attention over the row is exact for every real token: a causal model never
lets a real token see the padding after it.

On CUDA the per-sequence calls run on the flash kernel (`shape_free_sdpa`): the cuDNN kernel,
which PyTorch may pick, plans per shape, and a batch of new lengths then costs a plan per
sequence per layer (bench/trainer_step.py on an H100: 80-84 s per Qwen2.5-3B step instead of
36-39 s).

Registered under `VARLEN` in transformers' attention registry; transformers builds no mask for
a custom implementation, which is what both paths want.

Plain causal attention only: sliding windows, attention-logit softcapping and attention sinks
would be silently ignored, so `use_varlen` refuses such models (pick another
`attn_implementation` for them) and the function refuses them again if they show up at call
time under names the config check does not know.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.nn.functional as F
from torch import nn

VARLEN = "searchr1_varlen"
# What transformers' attention modules pass for a sliding window, logit softcapping and sinks.
_CALL_ARGS = ("sliding_window", "softcap", "s_aux")


# On CUDA: kernels with no per-shape set-up, fastest first (flash has no fp32: fp32 falls back
# to the memory-efficient kernel).
_SHAPE_FREE = (
    torch.nn.attention.SDPBackend.FLASH_ATTENTION,
    torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
    torch.nn.attention.SDPBackend.MATH,
)


def shape_free_sdpa(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Around per-sequence `scaled_dot_product_attention` calls: keep PyTorch off the cuDNN
    kernel on CUDA (its per-shape plans cost ~25 ms per new length on an H100)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.nn.attention.sdpa_kernel(list(_SHAPE_FREE))


def varlen_causal_attention(
    module: nn.Module,
    query: torch.Tensor,  # [B, H, L, D]
    key: torch.Tensor,  # [B, Hkv, L, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    for name in _CALL_ARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"the varlen attention does not implement `{name}`")
    with shape_free_sdpa(query.device):
        return _varlen(query, key, value, scaling, dropout, cu_seq_lens_q), None


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    dropout: float,
    cu_seq_lens_q: torch.Tensor | None,
) -> torch.Tensor:
    gqa = query.shape[1] != key.shape[1]
    if cu_seq_lens_q is None:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa
        )
    else:
        if query.shape[0] != 1:
            raise ValueError("packed attention expects a batch of one packed row")
        bounds = cu_seq_lens_q.tolist()
        parts = [
            F.scaled_dot_product_attention(
                query[:, :, s:e],
                key[:, :, s:e],
                value[:, :, s:e],
                is_causal=True,
                scale=scaling,
                dropout_p=dropout,
                enable_gqa=gqa,
            )
            for s, e in itertools.pairwise(bounds)
            if e > s
        ]
        out = torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous()


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_causal_attention)
    return VARLEN


def unsupported_features(model: nn.Module) -> list[str]:
    """The model's attention features that the varlen attention would ignore, by config field."""
    cfg = getattr(model, "config", None)
    found: list[str] = []
    window = getattr(cfg, "sliding_window", None)
    layer_types: list[str] | None = getattr(cfg, "layer_types", None)
    # Qwen2 keeps `sliding_window` only with use_sliding_window, and slides only in the layers
    # `layer_types` marks; models without layer_types (Mistral) slide everywhere when it is set.
    if window is not None and (layer_types is None or "sliding_attention" in layer_types):
        flag = getattr(cfg, "use_sliding_window", None)
        found.append(f"sliding_window={window}" + (f" (use_sliding_window={flag})" if flag else ""))
    other = sorted(set(layer_types or []) - {"full_attention", "sliding_attention"})
    if other:
        found.append(f"layer_types {other}")
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap is not None:
        found.append(f"attn_logit_softcapping={softcap}")
    # Sinks (gpt-oss) have no config field: they are a parameter of each attention module.
    sinks = next(
        (m for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.Tensor)), None
    )
    if sinks is not None:
        found.append(f"attention sinks (`sinks` of {type(sinks).__name__})")
    return found


def use_varlen(model: nn.Module) -> None:
    """Switch a loaded Hugging Face model to the varlen attention, or refuse it (ValueError)."""
    found = unsupported_features(model)
    if found:
        raise ValueError(
            "trainer.model.attn_implementation=varlen would ignore this model's "
            f"{', '.join(found)}: set trainer.model.attn_implementation to one that implements "
            "them (eager, or flash_attention_2 / sdpa where the model supports them)"
        )
    register()
    model.set_attn_implementation(VARLEN)  # type: ignore[operator]
