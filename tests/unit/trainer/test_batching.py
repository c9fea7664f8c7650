"""Packing vs padding: identical logprobs; budgets respected; trajectory conversion."""

from __future__ import annotations

import math

import torch

from tests.unit.trainer.conftest import make_batch, make_trajectory
from trainer.attention import use_varlen
from trainer.batching import (
    build_microbatch,
    plan_microbatches,
    sequence_from_trajectory,
    shard_plan,
    split_minibatches,
)


def _logprobs(model, samples, idxs, packed, varlen=False):  # type: ignore[no-untyped-def]
    mb = build_microbatch(samples, idxs, packed=packed)
    extra = {"cu_seq_lens_q": mb.cu_seqlens} if varlen and packed else {}
    with torch.no_grad():
        out = model(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            attention_mask=mb.attention_mask,
            use_cache=False,
            logits_to_keep=mb.keep_positions,
            **extra,
        )
    rows = out.logits[mb.row_batch, mb.row_keep]
    return torch.log_softmax(rows, -1).gather(-1, mb.targets[:, None]).squeeze(-1), mb


def test_packed_equals_unpacked_and_padded(tiny_model) -> None:  # type: ignore[no-untyped-def]
    samples = [sequence_from_trajectory(t)[0] for t in make_batch(2, 3)]
    idxs = list(range(len(samples)))
    packed, mb = _logprobs(tiny_model, samples, idxs, packed=True)
    padded, _ = _logprobs(tiny_model, samples, idxs, packed=False)
    # Reference: each sequence alone, full logits.
    alone = []
    for s in samples:
        with torch.no_grad():
            logits = tiny_model(input_ids=torch.as_tensor(s.input_ids)[None]).logits[0]
        lp = torch.log_softmax(logits[s.prompt_len - 1 : -1], -1)
        alone.append(
            lp.gather(-1, torch.as_tensor(s.input_ids[s.prompt_len :])[:, None]).squeeze(-1)
        )
    ref = torch.cat(alone)
    assert mb.input_ids.shape[0] == 1 and mb.num_tokens == mb.padded_tokens
    assert torch.allclose(packed, ref, atol=1e-5)
    assert torch.allclose(padded, ref, atol=1e-5)
    # The varlen attention (per-sequence fused causal kernels), packed and padded (no mask).
    use_varlen(tiny_model)
    for packed_flag in (True, False):
        varlen, _ = _logprobs(tiny_model, samples, idxs, packed=packed_flag, varlen=True)
        assert torch.allclose(varlen, ref, atol=1e-5)


def test_plan_respects_budget_and_covers_all() -> None:
    lengths = [50, 10, 30, 70, 20, 200, 5]
    plan = plan_microbatches(lengths, 100)
    flat = sorted(i for b in plan for i in b)
    assert flat == list(range(len(lengths)))
    for b in plan:
        assert sum(lengths[i] for i in b) <= 100 or len(b) == 1
    # First-fit decreasing: 200 | 70+30 | 50+20+10+5 (arrival order inside a bin).
    assert plan == [[5], [2, 3], [0, 1, 4, 6]]
    padded = plan_microbatches(lengths, 100, packed=False)
    for b in padded:
        assert max(lengths[i] for i in b) * len(b) <= 100 or len(b) == 1


def test_shard_plan_gives_every_rank_the_same_count() -> None:
    plan = [[0], [1], [2]]
    assert shard_plan(plan, 2, 0) == [[0], [2]]
    assert shard_plan(plan, 2, 1) == [[1], []]


def test_split_minibatches() -> None:
    assert split_minibatches(5, 2) == [[0, 1], [2, 3, 4]]
    assert split_minibatches(2, 4) == [[0], [1]]


def test_nonfinite_rollout_logprobs_are_masked() -> None:
    t = make_trajectory(
        "t",
        "g",
        1.0,
        prompt_len=2,
        response_len=3,
        seed=0,
        rollout_logprobs=[-1.0, math.nan, -math.inf],
    )
    s, bad = sequence_from_trajectory(t)
    assert bad == 2
    assert s.loss_mask.tolist() == [1.0, 0.0, 0.0]
    assert torch.isfinite(s.rollout_logprobs).all()
