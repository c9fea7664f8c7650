"""Core attention per sequence of a packed row, for the local layer spec (no Transformer Engine).

Megatron's local `DotProductAttention` has no packed (THD) path: a packed row needed a dense
`[1, 1, L, L]` block-diagonal mask and scores over the whole row, O(L^2) in time and memory
(at 8,192 tokens per row, 1 GB of scores per layer on a 128-wide model, a demo step of 187 s).
`SegmentAttention` runs `scaled_dot_product_attention(is_causal=True)` on each sequence
instead, as the HF backend's `varlen` does (`trainer/attention.py`): O(sum of L_i^2), on the
flash kernel on CUDA (`shape_free_sdpa`: no per-shape planning for each new length).

The model's `attention_mask` argument carries the sequence lengths
(`trainer.backends.megatron.parallel.segment_lengths`), a small
CPU tensor: Megatron passes it unchanged to every layer's core attention, on every pipeline
stage and through activation recompute (it is an argument, not module state).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention

from trainer.attention import shape_free_sdpa


class SegmentAttention(DotProductAttention):
    """`DotProductAttention` with `attention_mask` = `segment_lengths`: causal attention within
    each sequence, none across sequences. Same scale and GQA expansion as Megatron's."""

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
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        p = self.attention_dropout.p if self.training else 0.0
        # Dropout draws from the model-parallel RNG, as Megatron's own attention does.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if p > 0 else contextlib.nullcontext()
        with rng, shape_free_sdpa(q.device):
            context = self._attend(q, k, v, attention_mask, p)
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, p: float
    ) -> torch.Tensor:
        """`[b, h, s, d]` in and out; causal SDPA per segment of each row."""
        sq = q.shape[2]
        rows = []
        for row, row_lengths in enumerate(lengths.tolist()):
            parts, start = [], 0
            for n in row_lengths:
                if n <= 0:
                    continue
                end = start + n
                parts.append(
                    F.scaled_dot_product_attention(
                        q[row : row + 1, :, start:end],
                        k[row : row + 1, :, start:end],
                        v[row : row + 1, :, start:end],
                        is_causal=True,
                        dropout_p=p,
                        scale=self.softmax_scale,
                    )
                )
                start = end
            assert start == sq, f"segment lengths sum to {start}, the row has {sq} tokens"
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows, dim=0)
