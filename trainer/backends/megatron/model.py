"""A Megatron-Core `GPTModel` built from a Hugging Face config (Qwen2 / Qwen2.5 / Llama).

`ModelShape` is what the two worlds share (sizes, norms, biases, RoPE); `shape_from_hf` reads it
from a `PretrainedConfig` and refuses what the local layer spec cannot express, `build_gpt`
makes this rank's (TP shard, PP stage) model. Positions: Megatron computes RoPE for 0..L-1 of
the row; a packed row restarts positions per sequence, so `PositionalRotary` replaces the
rotary module and indexes the frequencies by the row's `position_ids` (the same angles, to the
bit, as the Hugging Face model computes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_SUPPORTED = ("qwen2", "llama")
_ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    qkv_bias: bool
    tied: bool
    max_positions: int
    attention_dropout: float
    inv_freq: tuple[float, ...]  # RoPE inverse frequencies (scaling already applied)


def _rope_inv_freq(hf: Any) -> tuple[float, ...]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(hf, "rope_parameters", None) or {})
    kind = params.get("rope_type", "default")
    if kind == "default":
        base = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        dim = _head_dim(hf)
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scale = 1.0
    elif kind in ("linear", "llama3"):
        inv, scale = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"))
    else:
        # dynamic NTK changes with the length, yarn/longrope scale the attention: not expressible
        raise ValueError(f"rope_type {kind!r} is not supported by the Megatron backend")
    if scale != 1.0:
        raise ValueError(f"rope_type {kind!r} scales attention ({scale}); not supported")
    return tuple(float(x) for x in inv)


def _head_dim(hf: Any) -> int:
    return int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def shape_from_hf(hf: Any) -> ModelShape:
    """Read and check a Hugging Face config; ValueError names what is not supported."""
    if hf.model_type not in _SUPPORTED:
        raise ValueError(f"model_type {hf.model_type!r}: the Megatron backend builds {_SUPPORTED}")
    if getattr(hf, "hidden_act", "silu") not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported (SwiGLU only)")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("use_sliding_window: the Megatron backend has no sliding window")
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias: not supported")
    if hf.model_type == "llama" and getattr(hf, "attention_bias", False):
        raise ValueError("attention_bias (Llama: also on o_proj): not supported")
    qkv_bias = hf.model_type == "qwen2"  # Qwen2 has q/k/v biases, no o_proj bias
    return ModelShape(
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=int(hf.num_attention_heads),
        num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads),
        head_dim=_head_dim(hf),
        rms_eps=float(hf.rms_norm_eps),
        qkv_bias=qkv_bias,
        tied=bool(getattr(hf, "tie_word_embeddings", False)),
        max_positions=int(hf.max_position_embeddings),
        attention_dropout=float(getattr(hf, "attention_dropout", 0.0) or 0.0),
        inv_freq=_rope_inv_freq(hf),
    )


def padded_vocab(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron splits the vocabulary evenly over TP ranks: pad to `multiple * tp`."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def transformer_config(shape: ModelShape, *, tp: int, pp: int, dtype: torch.dtype, cpu: bool):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        layernorm_epsilon=shape.rms_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,  # Qwen2 / Llama have none
        attention_dropout=shape.attention_dropout,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        # bf16: the model's weights are bf16, the (distributed) optimizer keeps fp32 main copies.
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        attention_softmax_in_fp32=True,
        # Packed micro-batches differ in length: p2p sends the shape first.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # unused (dense); "allgather" refuses the above
        use_cpu_initialization=cpu,
        # Overwritten by the Hugging Face weights right after building, but needed anyway: the
        # initializers are what mark TP-sharded parameters (`tensor_model_parallel`), without
        # which the grad norm counts them once instead of summing their shards.
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=False,
    )


class PositionalRotary(nn.Module):
    """Drop-in for `GPTModel.rotary_pos_emb`: RoPE angles of the row's `position_ids`."""

    def __init__(self, inv_freq: tuple[float, ...], inner: nn.Module) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor(inv_freq, dtype=torch.float32), False)
        self.inner = inner  # keeps `get_rotary_seq_len` and friends
        self.position_ids: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.position_ids is not None, "position_ids are set by the model's pre-hook"
        # Every row of a micro-batch has the same positions (one packed row, or a padded
        # batch of arange rows), so the first row serves all.
        pos = self.position_ids[0].to(self.inv_freq.device, torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def _capture_positions(module: nn.Module, args: tuple, kwargs: dict) -> None:
    pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
    module.rotary_pos_emb.position_ids = pos


def build_gpt(shape: ModelShape, config: Any, *, vocab: int, pre: bool, post: bool) -> nn.Module:
    """This rank's `GPTModel` (its TP shard of the layers of its PP stage)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # optional: megatron-core (attention imports it at module top; convert uses this module)
    from trainer.backends.megatron.attention import SegmentAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    # Per-sequence attention of packed rows (the local spec has no packed path of its own).
    spec.submodules.self_attention.submodules.core_attention = SegmentAttention
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=shape.max_positions,
        pre_process=pre,
        post_process=post,
        parallel_output=True,  # vocab-parallel logits: never gathered
        share_embeddings_and_output_weights=shape.tied,
        position_embedding_type="rope",
    )
    model.rotary_pos_emb = PositionalRotary(shape.inv_freq, model.rotary_pos_emb)
    model.register_forward_pre_hook(_capture_positions, with_kwargs=True)
    return model
