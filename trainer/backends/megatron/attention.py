"""Core attention per sequence of a packed row, for the local layer spec (no Transformer Engine).

Megatron's local `DotProductAttention` has no packed (THD) path: a packed row needed a dense
`[1, 1, L, L]` block-diagonal mask and scores over the whole row, O(L^2) in time and memory
(at 8,192 tokens per row, 1 GB of scores per layer on a 128-wide model, a demo step of 187 s).
`SegmentAttention` attends within each sequence instead, as the HF backend's `varlen` does
(`trainer.attention.packed_causal_attention`): O(sum of L_i^2), one FlashAttention varlen call
per layer on CUDA in bf16, `scaled_dot_product_attention(is_causal=True)` per sequence elsewhere.
Grouped KV heads go to the kernel unexpanded.

The model's `attention_mask` argument carries the sequence lengths
(`trainer.backends.megatron.parallel.segment_lengths`), a small
CPU tensor: Megatron passes it unchanged to every layer's core attention, on every pipeline
stage and through activation recompute (it is an argument, not module state).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention

from trainer.attention import PackedBounds, packed_causal_attention


class _LastBounds:
    """The `PackedBounds` of the last `segment_lengths` a layer was handed. Megatron hands
    the same tensor to every layer of a forward (and to the layers it recomputes), so the
    bounds are built, and copied to the device, once per forward instead of once per layer.
    Holding the tensor keeps the identity check sound (its id cannot be reused meanwhile)."""

    lengths: torch.Tensor | None = None
    bounds: PackedBounds | None = None

    @classmethod
    def of(cls, lengths: torch.Tensor, tokens: int, device: torch.device) -> PackedBounds:
        if lengths is cls.lengths and cls.bounds is not None and cls.bounds.device.device == device:
            return cls.bounds
        per_row = lengths.sum(dim=1)
        assert bool((per_row == tokens).all()), (
            f"segment lengths sum to {per_row.tolist()} per row, each row has {tokens} tokens"
        )
        flat = lengths.reshape(-1)  # every row's segments, one after another
        flat = flat[flat > 0]
        cu = torch.zeros(flat.numel() + 1, dtype=torch.int64)
        torch.cumsum(flat, 0, out=cu[1:])
        cls.lengths, cls.bounds = lengths, PackedBounds.of(cu, device)
        return cls.bounds


class SegmentAttention(DotProductAttention):
    """`DotProductAttention` with `attention_mask` = `segment_lengths`: causal attention within
    each sequence, none across sequences, at Megatron's scale."""

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: object = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object = None,
    ) -> torch.Tensor:
        assert packed_seq_params is None and attention_bias is None
        assert attention_mask is not None and attention_mask.dtype == torch.int64, (
            "SegmentAttention takes segment_lengths as its attention_mask"
        )
        sq, b, heads, dim = query.shape
        bounds = _LastBounds.of(attention_mask, sq, query.device)
        # [s, b, h, d] -> [b * s, h, d]: the rows one after another, as one packed row.
        q, k, v = (t.transpose(0, 1).reshape(b * sq, t.shape[2], dim) for t in (query, key, value))
        p = self.attention_dropout.p if self.training else 0.0
        # Dropout draws from the model-parallel RNG, as Megatron's own attention does.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if p > 0 else contextlib.nullcontext()
        with rng:
            context = packed_causal_attention(q, k, v, bounds, scale=self.softmax_scale, dropout=p)
        return context.reshape(b, sq, heads * dim).transpose(0, 1).contiguous()
