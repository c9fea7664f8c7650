"""Logprobs and entropy from vocab-parallel logits (each TP rank holds a slice of the vocabulary).

The full vocabulary is never gathered on one rank: the max, the sum of exponentials, the target
logit and `sum(exp(z) * z)` are reduced over the TP group (the vocab-parallel cross-entropy
pattern), so a rank holds only `[T, V / tp]`. The reductions that carry gradient use Megatron's
`reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward: every TP
rank computes the same loss, so each gets the gradient of its own slice). The max is a
constant shift (no gradient needed). Padded vocabulary rows (TP padding) are masked out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_size() -> int:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def _tp_reduce(x: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if _tp_size() == 1:
        return x
    return reduce_from_tensor_model_parallel_region(x)


def _tp_max(x: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    x = x.detach().clone()
    if _tp_size() > 1:
        dist.all_reduce(
            x, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
        )
    return x


def return_hidden_states(model: torch.nn.Module) -> None:
    """Make a last-stage `GPTModel` return its final hidden states `[b, s, h]` where it returned
    logits: its output layer passes them through, for `head_stats` to run the head in chunks
    (trainer.logprobs). The layer keeps its weight (checkpoints and pushes are unchanged)."""

    def passthrough(
        hidden: torch.Tensor, weight: object = None, runtime_gather_output: object = None
    ) -> tuple[torch.Tensor, None]:
        return hidden, None

    model.output_layer.forward = passthrough  # type: ignore[method-assign]


def head_weight(model: torch.nn.Module) -> torch.Tensor:
    """This TP rank's slice of the LM head of a last-stage `GPTModel` (under DDP or not): the
    embedding when the two are tied."""
    m = getattr(model, "module", model)
    if m.share_embeddings_and_output_weights:
        return m.shared_embedding_or_output_weight()
    return m.output_layer.weight


def tp_group() -> dist.ProcessGroup | None:
    from megatron.core import parallel_state

    if _tp_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logits [T, V_local]` of this TP rank's vocabulary slice starting at `vocab_start`;
    `vocab_size` is the real (unpadded) vocabulary. Returns fp32 `log softmax(logits / t)` at
    `targets` and, when `entropy`, the entropy of `softmax(logits / t)`, both `[T]` (the
    entropy carries no gradient unless `entropy_grad`)."""
    x = logits.float() / temperatures.to(logits.device, torch.float32)[:, None]
    local = x.shape[-1]
    ids = torch.arange(vocab_start, vocab_start + local, device=x.device)
    pad = ids >= vocab_size
    if vocab_start + local > vocab_size:  # from the ints: no device sync
        x = x.masked_fill(pad, float("-inf"))
    z = x - _tp_max(x.max(dim=-1).values)[:, None]
    e = z.exp()
    total = _tp_reduce(e.sum(dim=-1))
    log_total = total.log()
    t = targets.to(x.device) - vocab_start
    mine = (t >= 0) & (t < local)
    picked = z.gather(-1, t.clamp(0, local - 1)[:, None]).squeeze(-1)
    target_z = _tp_reduce(torch.where(mine, picked, torch.zeros_like(picked)))
    logp = target_z - log_total
    if not entropy:
        return logp, None
    if not entropy_grad:
        e, z, total, log_total = e.detach(), z.detach(), total.detach(), log_total.detach()
    # H = log Z - sum(p z) = log Z - sum(exp(z) z) / Z
    ez = (e * z.masked_fill(pad, 0.0)).sum(dim=-1)
    ent = log_total - _tp_reduce(ez) / total
    return logp, ent
