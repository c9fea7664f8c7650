"""HF <-> Megatron weight conversion: exact round trips, layouts, TP shards (no megatron-core
needed: conversion is plain tensor work)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.trainer.conftest import tiny_qwen2
from trainer.backends.megatron import convert
from trainer.backends.megatron.model import padded_vocab, shape_from_hf


def _model(tied: bool):  # type: ignore[no-untyped-def]
    model = tiny_qwen2()
    if tied:
        from transformers import Qwen2ForCausalLM

        model.config.tie_word_embeddings = True
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(model.config)
    return model


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bit_exact(tied: bool, tp: int) -> None:
    model = _model(tied)
    shape = shape_from_hf(model.config)
    hf = model.state_dict()
    full = convert.hf_to_full(hf, shape, padded_vocab(shape.vocab_size, tp, 96))
    # Through the TP shards too: what a rank holds and what a gather rebuilds.
    full = {
        k: convert.unshard(k, [convert.shard(k, v, r, tp) for r in range(tp)])
        for k, v in full.items()
    }
    back = convert.full_to_hf(full, shape)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k
    assert ("output_layer.weight" in full) is not tied


def test_layouts() -> None:
    shape = shape_from_hf(tiny_qwen2().config)  # 4 heads, 2 kv groups, head_dim 16
    d, per = shape.head_dim, shape.num_heads // shape.num_kv_heads
    q = torch.arange(shape.num_heads * d, dtype=torch.float32)[:, None]
    k = 1000 + torch.arange(shape.num_kv_heads * d, dtype=torch.float32)[:, None]
    v = 2000 + torch.arange(shape.num_kv_heads * d, dtype=torch.float32)[:, None]
    qkv = convert._fuse_qkv(q, k, v, shape)
    # Query group 0: its two query heads, then its key head, then its value head.
    assert torch.equal(qkv[: per * d], q[: per * d])
    assert torch.equal(qkv[per * d : per * d + d], k[:d])
    assert torch.equal(qkv[per * d + d : per * d + 2 * d], v[:d])
    # TP=2: rank 1 holds group 1 whole; fc1 shards are [gate half; up half].
    assert torch.equal(
        convert.shard("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 1, 2),
        qkv[(per + 2) * d :],
    )
    fc1 = torch.arange(8.0)[:, None]  # gate 0..3, up 4..7
    got = convert.shard("decoder.layers.1.mlp.linear_fc1.weight", fc1, 1, 2)
    assert got[:, 0].tolist() == [2.0, 3.0, 6.0, 7.0]
    proj = torch.arange(8.0).reshape(2, 4)
    got = convert.shard("decoder.layers.0.self_attention.linear_proj.weight", proj, 0, 2)
    assert torch.equal(got, proj[:, :2])


def test_vocab_padding_and_names() -> None:
    model = tiny_qwen2()
    shape = shape_from_hf(model.config)
    full = convert.hf_to_full(model.state_dict(), shape, 256)
    emb = full["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 256 and not emb[shape.vocab_size :].any()
    assert padded_vocab(151936, 4) == 152064 and padded_vocab(128, 2) == 256
    assert convert.to_local("decoder.layers.5.mlp.linear_fc2.weight", 4) == (
        "decoder.layers.1.mlp.linear_fc2.weight"
    )
    assert convert.full_name("output_layer.weight", 0, shape) == "output_layer.weight"


def test_unsupported_configs_are_refused() -> None:
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="use_sliding_window"):
        shape_from_hf(tiny_qwen2(use_sliding_window=True).config)
    with pytest.raises(ValueError, match="attention_bias"):
        shape_from_hf(LlamaConfig(attention_bias=True))
    with pytest.raises(ValueError, match="yarn"):
        shape_from_hf(
            LlamaConfig(
                rope_scaling={
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "original_max_position_embeddings": 1024,
                }
            )
        )
    llama = shape_from_hf(
        LlamaConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128
        )
    )
    assert not llama.qkv_bias and llama.head_dim == 16
