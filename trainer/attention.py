"""Variable-length causal attention for packed micro-batches, on any device.

transformers turns packed `position_ids` into a dense block-diagonal mask for `sdpa`, which
costs O(L^2) over the whole packed row (and loses the fused kernels): packing then runs slower
than padding on CPU. This attention function instead runs `scaled_dot_product_attention` with
`is_causal=True` on each packed sequence (boundaries from `cu_seq_lens_q`, which the backend
passes as `PackedBounds`, built once per micro-batch), costing sum(L_i^2) with the fused
kernels. Without boundaries (the padded path, right padding), one causal attention over the
row is exact for every real token: a causal model never lets a real token see the padding
after it.

On CUDA in bf16/fp16 a packed row is one call per layer: PyTorch's FlashAttention varlen kernel
over `cu_seqlens` (`packed_causal_attention`, shared with the Megatron backend). Elsewhere (CPU,
fp32, dropout) it falls back to the per-sequence calls, on the flash kernel on CUDA
(`shape_free_sdpa`): the cuDNN kernel, which PyTorch may pick, plans per shape, and a batch of
new lengths then costs a plan per sequence per layer (bench/trainer_step.py on an H100: 80-84 s
per Qwen2.5-3B step instead of 36-39 s).

Registered under `VARLEN` in transformers' attention registry; transformers builds no mask for
a custom implementation, which is what both paths want.

Plain causal attention only: sliding windows, attention-logit softcapping and attention sinks
would be silently ignored, so `use_varlen` refuses such models (pick another
`attn_implementation` for them) and the function refuses them again if they show up at call
time under names the config check does not know.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VARLEN = "searchr1_varlen"
VARLEN_RECOMPUTED = "searchr1_varlen_recomputed"
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
    cu_seq_lens_q: torch.Tensor | PackedBounds | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    for name in _CALL_ARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"the varlen attention does not implement `{name}`")
    if cu_seq_lens_q is None:
        with shape_free_sdpa(query.device):
            out = F.scaled_dot_product_attention(
                query,
                key,
                value,
                is_causal=True,
                scale=scaling,
                dropout_p=dropout,
                enable_gqa=query.shape[1] != key.shape[1],
            )
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError("packed attention expects a batch of one packed row")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [L, H, D]
    out = packed_causal_attention(q, k, v, cu_seq_lens_q, scale=scaling, dropout=dropout)
    return out[None], None


def varlen_causal_attention_recomputed(
    module: nn.Module, query: torch.Tensor, *args: object, **kwargs: object
) -> tuple[torch.Tensor, None]:
    """`varlen_causal_attention` under activation checkpointing while training (selective
    recompute of the core attention: its inputs are kept, its internals recomputed)."""
    if not (module.training and torch.is_grad_enabled()):
        return varlen_causal_attention(module, query, *args, **kwargs)  # type: ignore[arg-type]
    out = checkpoint(
        lambda q: varlen_causal_attention(module, q, *args, **kwargs)[0],  # type: ignore[arg-type]
        query,
        use_reentrant=False,
    )
    return out, None


# -- one call per packed row ---------------------------------------------------------------


@functools.cache
def _flash_varlen() -> tuple[Callable[..., torch.Tensor], dict[str, object], bool] | None:
    """PyTorch's FlashAttention varlen kernel (torch >= 2.10), its causal argument (2.10 took
    `is_causal`, later releases a `window_size`) and whether it takes grouped KV heads."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal: dict[str, object] = (
        {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    )
    return varlen_attn, causal, "enable_gqa" in params


def flash_varlen_applies(query: torch.Tensor, dropout: float) -> bool:
    """Whether `packed_causal_attention` takes the one-call varlen kernel: CUDA, 16-bit, no
    dropout (the kernel has none) and a PyTorch that has it."""
    return (
        query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and dropout == 0.0
        and _flash_varlen() is not None
    )


@dataclasses.dataclass(frozen=True)
class PackedBounds:
    """A packed row's sequence bounds in both places the attention reads them: on the CPU
    (the per-sequence fallback, and the longest sequence the kernel is told) and on the
    compute device (the varlen kernel's `cu_seqlens`). Built once per micro-batch and handed to
    every layer: a copy per layer would put a host-to-device copy from pageable memory, which
    the driver may serialize with the stream, in every layer of every forward."""

    host: torch.Tensor  # [N + 1] int64, on the CPU
    device: torch.Tensor  # [N + 1] int32, on the compute device
    longest: int

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, device: torch.device) -> PackedBounds:
        host = cu_seqlens.to("cpu", torch.int64)
        longest = int((host[1:] - host[:-1]).max()) if host.numel() > 1 else 0
        return cls(host, host.to(device, torch.int32, non_blocking=True), longest)


def packed_causal_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | PackedBounds,  # [N + 1] sequence bounds (a CPU tensor)
    *,
    scale: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed row, none across; `[T, H, D]` out.

    On CUDA in bf16/fp16 one FlashAttention varlen call over all sequences; elsewhere (CPU,
    fp32, dropout) `scaled_dot_product_attention` per sequence, on the flash kernel on CUDA.
    Pass `PackedBounds` where many layers share the bounds."""
    query, key, value = _in_autocast_dtype(query, key, value)
    if flash_varlen_applies(query, dropout):
        kernel, causal, takes_gqa = _flash_varlen()  # type: ignore[misc]
        bounds = (
            cu_seqlens
            if isinstance(cu_seqlens, PackedBounds)
            else PackedBounds.of(cu_seqlens, query.device)
        )
        extra = dict(causal)
        if query.shape[1] != key.shape[1]:
            if takes_gqa:
                extra["enable_gqa"] = True
            else:
                groups = query.shape[1] // key.shape[1]
                key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        return kernel(
            query.contiguous(),
            key.contiguous(),
            value.contiguous(),
            bounds.device,
            bounds.device,
            bounds.longest,
            bounds.longest,
            scale=scale,
            **extra,
        )
    host = cu_seqlens.host if isinstance(cu_seqlens, PackedBounds) else cu_seqlens
    return per_sequence_attention(query, key, value, host, scale=scale, dropout=dropout)


def _in_autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` in the autocast dtype where autocast is on for their device, as
    `scaled_dot_product_attention` would cast them. Under autocast over fp32 weights (the HF
    backend) the rotary embedding, computed from the fp32 residual stream, promotes q and k to
    fp32 while v stays 16-bit: left so, the one-call kernel (16-bit only) would be refused and
    every layer would fall back to a call per sequence."""
    kind = tensors[0].device.type
    if not torch.is_autocast_enabled(kind):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) for t in tensors)


def per_sequence_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """`packed_causal_attention`'s fallback: `scaled_dot_product_attention` per sequence."""
    gqa = query.shape[1] != key.shape[1]
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, H, T, D]
    with shape_free_sdpa(query.device):
        parts = [
            F.scaled_dot_product_attention(
                q[:, :, s:e],
                k[:, :, s:e],
                v[:, :, s:e],
                is_causal=True,
                scale=scale,
                dropout_p=dropout,
                enable_gqa=gqa,
            )
            for s, e in itertools.pairwise(cu_seqlens.tolist())
            if e > s
        ]
    return torch.cat(parts, dim=2)[0].transpose(0, 1)


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_causal_attention)
    AttentionInterface.register(VARLEN_RECOMPUTED, varlen_causal_attention_recomputed)
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


def use_varlen(model: nn.Module, *, recompute: bool = False) -> None:
    """Switch a loaded Hugging Face model to the varlen attention (its core attention
    recomputed in the backward with `recompute`), or refuse it (ValueError)."""
    found = unsupported_features(model)
    if found:
        raise ValueError(
            "trainer.model.attn_implementation=varlen would ignore this model's "
            f"{', '.join(found)}: set trainer.model.attn_implementation to one that implements "
            "them (eager, or flash_attention_2 / sdpa where the model supports them)"
        )
    register()
    model.set_attn_implementation(VARLEN_RECOMPUTED if recompute else VARLEN)  # type: ignore[operator]
