"""Hugging Face <-> Megatron-Core weights: names, layouts, TP shards, vocabulary padding.

Three representations:
- **HF**: `model.layers.3.self_attn.q_proj.weight`, ... (what engines load and export writes).
- **full Megatron**: Megatron names with global layer indices and unsharded tensors in
  Megatron's layout: QKV fused per query group (`[q heads of the group; k; v]` for each of the
  `num_kv_heads` groups), `linear_fc1 = [gate; up]`, the vocabulary padded to the TP multiple.
- **shards**: what one (TP rank, PP stage) holds: local layer indices; column-parallel tensors
  split on dim 0 (QKV by whole groups, fc1 as its gate half and its up half), row-parallel ones
  on dim 1, norms replicated.
Every step only moves values (cat, split, view), so a round trip is bit-exact.
"""

from __future__ import annotations

import re

import torch

from trainer.backends.megatron.model import ModelShape

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron suffix within a layer -> Hugging Face suffix within `model.layers.N.`
_LAYER_1TO1 = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_COLUMN_PARALLEL = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "embedding.word_embeddings.weight",
    "output_layer.weight",
)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelShape) -> torch.Tensor:
    per = s.num_heads // s.num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(s.num_kv_heads, per * s.head_dim, *rest)
    k = k.reshape(s.num_kv_heads, s.head_dim, *rest)
    v = v.reshape(s.num_kv_heads, s.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, s: ModelShape) -> tuple[torch.Tensor, ...]:
    per = s.num_heads // s.num_kv_heads
    rest = qkv.shape[1:]
    g = qkv.reshape(s.num_kv_heads, (per + 2) * s.head_dim, *rest)
    q, k, v = torch.split(g, [per * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return tuple(x.reshape(-1, *rest) for x in (q, k, v))


def hf_to_full(hf: dict[str, torch.Tensor], s: ModelShape, vocab: int) -> dict[str, torch.Tensor]:
    """Hugging Face state dict -> full Megatron state dict (`vocab`: the padded size)."""
    out = {"embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], vocab)}
    for i in range(s.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mk, hk in _LAYER_1TO1.items():
            out[m + mk] = hf[h + hk]
        attn = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            *(hf[f"{attn}{x}_proj.weight"] for x in "qkv"), s
        )
        if s.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                *(hf[f"{attn}{x}_proj.bias"] for x in "qkv"), s
            )
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]]
        )
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not s.tied:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], vocab)
    return out


def to_hf_items(name: str, t: torch.Tensor, s: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """One full Megatron tensor -> its Hugging Face tensors (streaming `full_to_hf`)."""
    v = s.vocab_size
    if name == "embedding.word_embeddings.weight":
        out = [("model.embed_tokens.weight", t[:v])]
        return [*out, ("lm_head.weight", t[:v])] if s.tied else out
    if name == "output_layer.weight":
        return [("lm_head.weight", t[:v])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", t)]
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"unknown Megatron parameter {name}")
    h, suf = f"model.layers.{m.group(1)}.", m.group(2)
    if suf in _LAYER_1TO1:
        return [(h + _LAYER_1TO1[suf], t)]
    if suf.startswith("self_attention.linear_qkv."):
        kind = suf.rsplit(".", 1)[1]
        parts = _split_qkv(t, s)
        return [(f"{h}self_attn.{x}_proj.{kind}", p) for x, p in zip("qkv", parts, strict=True)]
    if suf == "mlp.linear_fc1.weight":
        gate, up = t.chunk(2)
        return [(h + "mlp.gate_proj.weight", gate), (h + "mlp.up_proj.weight", up)]
    raise ValueError(f"unknown Megatron parameter {name}")


def full_to_hf(full: dict[str, torch.Tensor], s: ModelShape) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_full` (drops the vocabulary padding)."""
    return {k: v for name, t in full.items() for k, v in to_hf_items(name, t, s)}


def _suffix(name: str) -> str:
    m = _LAYER.match(name)
    return m.group(2) if m else name


def tp_split(name: str) -> str:
    """How TP splits the full tensor `name`: `fc1` (its gate half and its up half, each on
    dim 0), `column` (dim 0), `row` (dim 1) or `none` (replicated)."""
    suf = _suffix(name)
    if suf == "mlp.linear_fc1.weight":
        return "fc1"
    if suf in _COLUMN_PARALLEL:
        return "column"
    return "row" if suf in _ROW_PARALLEL else "none"


def is_vocab(name: str) -> bool:
    """A tensor whose rows are the (padded) vocabulary."""
    return name in ("embedding.word_embeddings.weight", "output_layer.weight")


def shard(name: str, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This TP rank's part of the full tensor `name`."""
    split = tp_split(name)
    if split == "fc1":
        gate, up = t.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if split == "column":
        return t.chunk(tp)[rank]
    if split == "row":
        return t.chunk(tp, dim=1)[rank]
    return t


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every TP rank's part, in rank order."""
    suf = _suffix(name)
    if len(parts) == 1:
        return parts[0]
    if suf == "mlp.linear_fc1.weight":
        halves = [p.chunk(2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if suf in _COLUMN_PARALLEL:
        return torch.cat(parts)
    if suf in _ROW_PARALLEL:
        return torch.cat(parts, dim=1)
    return parts[0]


def to_local(name: str, offset: int) -> str:
    """Global layer index -> this PP stage's index (`offset`: its first layer)."""
    m = _LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) - offset}.{m.group(2)}" if m else name


def to_global(name: str, offset: int) -> str:
    m = _LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name


def full_name(local: str, offset: int, s: ModelShape) -> str:
    """The full-state name of a parameter of one PP stage's model. With tied embeddings the
    last stage of a pipeline holds its own copy of the embedding as `output_layer.weight`."""
    if local == "output_layer.weight" and s.tied:
        return "embedding.word_embeddings.weight"
    return to_global(local, offset)
