"""Variable-length causal attention for packed micro-batches, on any device.

transformers turns packed `position_ids` into a dense block-diagonal mask for `sdpa`, which
costs O(L^2) over the whole packed row (and loses the fused kernels): packing then runs slower
than padding on CPU. This attention function instead runs `scaled_dot_product_attention` with
`is_causal=True` on each packed sequence (boundaries from `cu_seq_lens_q`, passed by the
backend), costing sum(L_i^2) with the fused kernels. Without boundaries (the padded path, right
padding), one causal attention over the row is exact for every real token: a causal model never
lets a real token see the padding after it.

Registered under `VARLEN` in transformers' attention registry; transformers builds no mask for
a custom implementation, which is what both paths want.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

VARLEN = "searchr1_varlen"


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
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_causal_attention)
    return VARLEN


def use_varlen(model: nn.Module) -> None:
    """Switch a loaded Hugging Face model to the varlen attention."""
    register()
    model.set_attn_implementation(VARLEN)  # type: ignore[operator]
