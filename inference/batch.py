"""The running batch of the reference engine: rows, their left-padded KV cache, the forwards.

Per layer the cache is `[B, heads, L, dim]`; row i's tokens occupy columns `pad[i]..L-1`. An
attention mask hides the padding and explicit position ids give each row its own RoPE
positions, so a row computes what it would compute alone (up to floating-point noise). Rows
join between steps (the shorter side is left-padded to the longer) and leave (rows dropped,
columns that are padding in every remaining row trimmed). The cache excludes each row's last
sampled token: the next decode step feeds it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from inference.prefix_cache import KVRow

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [B, heads, L, dim]


@functools.cache
def _cache_arg(model_type: type) -> str:
    """The name under which this model's forward takes its KV cache: `cache` since transformers
    renamed it (passing `past_key_values` warns that it "will be removed in version 5.40.0"),
    `past_key_values` on the 5.x releases before. Either way a `DynamicCache` is passed and
    updated in place, and the K/V are read back from that object, not from the output."""
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _forward(model: Any, cache: Any, **inputs: Any) -> Any:
    """`model(**inputs)` on top of `cache` (a DynamicCache, grown in place), use_cache on."""
    return model(**inputs, **{_cache_arg(type(model)): cache}, use_cache=True)


def _layers(cache: Any) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _lpad(t: torch.Tensor, n: int) -> torch.Tensor:
    """Left-pad the sequence dimension (2) of a [B, heads, L, dim] tensor with n zeros."""
    return t if n == 0 else torch.nn.functional.pad(t, (0, 0, n, 0))


def prefill(
    model: Any,
    seqs: list[list[int]],
    pad_id: int,
    device: torch.device,
    cached: list[KVRow | None] | None = None,
) -> tuple[torch.Tensor, KV, list[int], list[int]]:
    """One left-padded forward over `seqs`: (last-position fp32 logits [n, V], KV, pads, used).

    `cached[i]`, when given, is the K/V (`[heads, c, dim]` per layer) of the first c tokens of
    `seqs[i]` (c < len(seqs[i]): the last token is always computed, for its logits). The pass
    feeds S = the longest uncached tail as input on top of a past of P columns, so every row
    ends at column P + S: row i (t tokens) starts at column P + S - t, its first `used[i]` =
    max(0, t - S) tokens come from `cached[i]` (left-padded with zeros into the past) and the
    rest is input, left-padded too. A row whose tail is shorter than S recomputes some cached
    tokens: the pass costs what its longest tail costs, whatever the others' hits.
    """
    from transformers import DynamicCache

    lengths = [len(s) for s in seqs]
    hits = [0 if c is None else c[0][0].shape[1] for c in cached or [None] * len(seqs)]
    assert all(h < t for h, t in zip(hits, lengths, strict=True)), "the last token is computed"
    new = max(t - h for t, h in zip(lengths, hits, strict=True))  # S
    past = max(lengths) - new  # P; the longest row takes `past` tokens from its cache
    used = [max(0, t - new) for t in lengths]
    starts = [past + new - t for t in lengths]  # each row's first column
    start = torch.tensor(starts, device=device)
    rows = [s[u:] for s, u in zip(seqs, used, strict=True)]
    ids = torch.tensor([[pad_id] * (new - len(r)) + r for r in rows], device=device)
    cols = torch.arange(past + new, device=device)
    if past:
        assert cached is not None
        ref = next(c for c, u in zip(cached, used, strict=True) if u)  # shape/dtype donor
        layers = []
        for layer, (k0, _) in enumerate(ref):
            ks, vs = [], []
            for c, u in zip(cached, used, strict=True):
                k = k0.new_zeros(k0.shape[0], past, k0.shape[2])
                v = torch.zeros_like(k)
                if u:
                    assert c is not None
                    k[:, past - u :], v[:, past - u :] = c[layer][0][:, :u], c[layer][1][:, :u]
                ks.append(k)
                vs.append(v)
            layers.append((torch.stack(ks), torch.stack(vs)))
        cache = DynamicCache(ddp_cache_data=layers, config=model.config)
    else:
        cache = DynamicCache(config=model.config)
    out = _forward(
        model,
        cache,
        input_ids=ids,
        attention_mask=(cols[None, :] >= start[:, None]).long(),
        position_ids=(cols[None, past:] - start[:, None]).clamp(min=0),
        logits_to_keep=1,
    )
    return out.logits[:, -1].float(), _layers(cache), starts, used


class RunningBatch:
    """Rows (any objects, e.g. requests) aligned with the rows of a left-padded KV cache."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[Any] = []
        self.pad: list[int] = []
        self.kv: KV = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list[Any], kv: KV, pads: list[int]) -> None:
        if not self.rows:
            self.rows, self.kv, self.pad = list(rows), kv, list(pads)
            return
        length, new_length = self.kv[0][0].shape[2], kv[0][0].shape[2]
        if new_length > length:  # widen the running batch on the left
            extra = new_length - length
            self.kv = [(_lpad(k, extra), _lpad(v, extra)) for k, v in self.kv]
            self.pad = [p + extra for p in self.pad]
            length = new_length
        extra = length - new_length
        self.kv = [
            (torch.cat([k, _lpad(nk, extra)]), torch.cat([v, _lpad(nv, extra)]))
            for (k, v), (nk, nv) in zip(self.kv, kv, strict=True)
        ]
        self.pad += [p + extra for p in pads]
        self.rows += list(rows)

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows at these indices."""
        if not keep:
            self.clear()
            return
        idx = torch.tensor(keep, device=self.device)
        pads = [self.pad[i] for i in keep]
        trim = min(pads)  # columns that are padding in every remaining row
        self.kv = [(k[idx, :, trim:], v[idx, :, trim:]) for k, v in self.kv]
        self.pad = [p - trim for p in pads]
        self.rows = [self.rows[i] for i in keep]

    def row_kv(self, i: int) -> KVRow:
        """Row i's K/V without its padding: per layer `[heads, n, dim]` (views)."""
        return [(k[i, :, self.pad[i] :], v[i, :, self.pad[i] :]) for k, v in self.kv]

    def clear(self) -> None:
        self.rows, self.pad, self.kv = [], [], []

    def decode(self, model: Any, last_tokens: list[int]) -> torch.Tensor:
        """Feed one token per row; grow the cache by one column; fp32 logits [B, V]."""
        from transformers import DynamicCache

        length = self.kv[0][0].shape[2]
        pad = torch.tensor(self.pad, device=self.device)
        cols = torch.arange(length + 1, device=self.device)
        cache = DynamicCache(ddp_cache_data=self.kv, config=model.config)
        out = _forward(
            model,
            cache,
            input_ids=torch.tensor(last_tokens, device=self.device)[:, None],
            attention_mask=(cols[None, :] >= pad[:, None]).long(),
            position_ids=(length - pad)[:, None],
        )
        self.kv = _layers(cache)
        return out.logits[:, -1].float()
