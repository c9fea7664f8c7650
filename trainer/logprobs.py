"""Token logprobs and entropies straight from the last hidden states, in chunks of tokens.

The plain path multiplies every kept hidden state by the LM head, keeps the fp32 logits
`[T, V]` (151,936 words for Qwen2.5: 2.4 GB per 4,096 tokens) and autograd keeps them and the
softmax for the backward, so peak memory grows with tokens x vocabulary. `head_token_stats`
instead runs the head on `chunk` tokens at a time, keeps only per-token numbers (logprob, log
normaliser, entropy), and in the backward recomputes each chunk's logits to form its gradient
(the head's matmul once more, a few % of a step). Peak memory: one chunk's logits.

Under tensor parallelism `weight` is this rank's slice of the vocabulary (rows
`vocab_start ...`): the max, the sum of exponentials, the target logit and `sum(p z)` are
summed over `group` (the vocab-parallel cross-entropy pattern); every rank holds the same
hidden states, so the gradient of the hidden states is summed over `group` in the backward.

Gradients, with `z` the scaled logits (`logits / t`), `p = softmax(z)`, `lp = log p`:
`d lp_target / dz = onehot(target) - p` and `d H / dz = -p (lp + H)`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_NEG_INF = float("-inf")


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


def _vocab_slice(
    targets: torch.Tensor, vocab_start: int, local: int, vocab_size: int
) -> tuple[torch.Tensor, bool, torch.Tensor, torch.Tensor]:
    """For this rank's `local` vocabulary rows from `vocab_start`: the TP padding rows (and
    whether there are any, from the ints: no device sync), each target's row in the slice
    (clamped) and whether the slice holds it."""
    ids = torch.arange(vocab_start, vocab_start + local, device=targets.device)
    pad = ids >= vocab_size
    local_t = targets - vocab_start
    mine = (local_t >= 0) & (local_t < local)
    return pad, vocab_start + local > vocab_size, local_t.clamp(0, local - 1), mine


class _HeadStats(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        inv_temp: torch.Tensor,
        vocab_start: int,
        vocab_size: int,
        chunk: int,
        group: dist.ProcessGroup | None,
        compute_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, local = hidden.shape[0], weight.shape[0]
        w = weight.to(compute_dtype)
        pad, has_pad, local_t, mine = _vocab_slice(targets, vocab_start, local, vocab_size)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = (hidden[s:e].to(compute_dtype) @ w.T).float() * inv_temp[s:e, None]
            if has_pad:
                z.masked_fill_(pad, _NEG_INF)
            m = z.max(dim=-1).values
            _all_reduce(m, group, dist.ReduceOp.MAX)
            z -= m[:, None]
            p = z.exp()
            total = p.sum(dim=-1)
            picked = z.gather(-1, local_t[s:e, None]).squeeze(-1)
            target = torch.where(mine[s:e], picked, torch.zeros_like(picked))
            if has_pad:
                z.masked_fill_(pad, 0.0)  # p is 0 there: keep 0 * -inf out of sum(p z)
            pz = (p * z).sum(dim=-1)
            packed = torch.stack([total, target, pz])  # one all-reduce for the three sums
            _all_reduce(packed, group, dist.ReduceOp.SUM)
            total, target, pz = packed
            log_total = total.log()
            logp[s:e] = target - log_total
            ent[s:e] = log_total - pz / total
            lse[s:e] = m + log_total
        ctx.save_for_backward(hidden, weight, targets, inv_temp, lse, ent)
        ctx.args = (vocab_start, vocab_size, chunk, group, compute_dtype)  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        g_logp: torch.Tensor | None,
        g_ent: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, inv_temp, lse, ent = ctx.saved_tensors  # type: ignore[attr-defined]
        vocab_start, vocab_size, chunk, group, compute_dtype = ctx.args  # type: ignore[attr-defined]
        nones = (None,) * 7
        if g_logp is None and g_ent is None:
            return (None, None, *nones)
        n, local = hidden.shape[0], weight.shape[0]
        w = weight.to(compute_dtype)
        pad, has_pad, local_t, mine = _vocab_slice(targets, vocab_start, local, vocab_size)
        grad_h = torch.empty(hidden.shape, dtype=compute_dtype, device=hidden.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e].to(compute_dtype)
            lp = (h @ w.T).float() * inv_temp[s:e, None] - lse[s:e, None]  # log p
            if has_pad:
                lp.masked_fill_(pad, _NEG_INF)
            p = lp.exp()
            gz = torch.zeros_like(p)
            if g_logp is not None:
                g = g_logp[s:e].float()
                gz -= p * g[:, None]
                # + g at the target, on the rank whose slice holds it (no host sync)
                gz.scatter_add_(1, local_t[s:e, None], torch.where(mine[s:e], g, 0.0)[:, None])
            if g_ent is not None:
                if has_pad:
                    lp.masked_fill_(pad, 0.0)
                gz -= p * (lp + ent[s:e, None]) * g_ent[s:e].float()[:, None]
            gz = (gz * inv_temp[s:e, None]).to(compute_dtype)
            grad_h[s:e] = gz @ w
            grad_w += (gz.T @ h).float()
        _all_reduce(grad_h, group, dist.ReduceOp.SUM)
        return (grad_h.to(hidden.dtype), grad_w.to(weight.dtype), *nones)


def head_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    chunk: int,
    compute_dtype: torch.dtype,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `log softmax(hidden @ weight.T / t)` at `targets` and the entropy of that
    distribution, both `[T]`, for `hidden [T, h]` and the head `weight [V_local, h]` (this
    rank's vocabulary slice from `vocab_start`; rows at or past `vocab_size` are padding).
    Both outputs carry gradient; detach the entropy where it must not."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    dev = hidden.device
    return _HeadStats.apply(
        hidden,
        weight,
        targets.to(dev),
        1.0 / temperatures.to(dev, torch.float32),
        vocab_start,
        weight.shape[0] + vocab_start if vocab_size is None else vocab_size,
        chunk,
        group,
        compute_dtype,
    )


def to_host(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """`values` (a pass's per-micro-batch logprobs) on the CPU, in one device-to-host copy
    after the pass: a copy per micro-batch would make the host wait for each micro-batch's
    forward before it could queue the next one's kernels. Each result owns its memory: a
    view would carry the whole pass when pickled (pipeline stages broadcast these)."""
    if not values:
        return []
    flat = torch.cat([v.reshape(-1) for v in values]).cpu()
    return [part.clone() for part in flat.split([v.numel() for v in values])]
