"""The Hugging Face backend on a tiny random Qwen2: a step moves logprobs the right way;
micro-batching and packing do not change the update; HF export loads back."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.unit.trainer.conftest import make_batch, tiny_qwen2
from trainer.backend import Policy
from trainer.backends.hf import HFBackend
from trainer.config import BatchConfig, LossConfig, OptimConfig, TrainerConfig
from trainer.dist import DistInfo
from trainer.step import build_sequences, sequence_logprobs, train_on

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def config(**batch: object) -> TrainerConfig:
    return TrainerConfig(
        optim=OptimConfig(lr=1e-2, grad_clip=1.0),
        loss=LossConfig(kl_coef=0.01, entropy_coef=0.001),
        batch=BatchConfig(**batch),  # type: ignore[arg-type]
    )


def test_step_moves_positive_advantage_logprobs_up() -> None:
    cfg = config()
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    trajs = make_batch(2, 4)
    seqs, advantages, _ = build_sequences(trajs, cfg)
    before = sequence_logprobs(seqs, backend, Policy.CURRENT, cfg)
    metrics = train_on(trajs, backend, cfg)
    after = sequence_logprobs(seqs, backend, Policy.CURRENT, cfg)
    pos = neg = 0
    for s, adv, b, a in zip(seqs, advantages.tolist(), before, after, strict=True):
        m = s.loss_mask > 0
        delta = float((a - b)[m].mean())
        if adv > 0:
            assert delta > 0, (s.sample_id, delta)
            pos += 1
        elif adv < 0:
            assert delta < 0, (s.sample_id, delta)
            neg += 1
    assert pos == 4 and neg == 4
    assert metrics["optimizer_steps"] == 1
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "lr", "clip_fraction_low"):
        assert key in metrics
    assert metrics["loss_mask/observation_fraction"] > 0


def test_observation_rollout_logprob_change_is_bit_identical() -> None:
    cfg = config()
    cfg.loss.old_logprobs = "rollout"  # type: ignore[assignment]
    trajs = make_batch(1, 4)
    for t in trajs:
        t.has_rollout_logprobs = True
        t.rollout_logprobs[:] = [-3.0] * len(t.rollout_logprobs)
    altered = copy.deepcopy(trajs)
    for t in altered:
        t.rollout_logprobs[1] = -50.0
    params = []
    for batch in (trajs, altered):
        backend = HFBackend(tiny_qwen2(), cfg, CPU)
        train_on(batch, backend, cfg)
        params.append(torch.cat([p.detach().flatten() for p in backend.model.parameters()]))
    assert torch.equal(params[0], params[1])


def _grads(backend: HFBackend) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in backend.model.parameters()])


@pytest.mark.parametrize("batch", [{"max_tokens_per_microbatch": 40}, {"packing": False}])
def test_microbatching_and_padding_give_the_same_update(batch: dict[str, object]) -> None:
    # Gradients, not parameters, are compared: Adam's first step is ~lr * sign(g), which turns
    # float noise on near-zero gradients into lr-sized differences.
    trajs = make_batch(2, 4)
    results = []
    for b in ({"max_tokens_per_microbatch": 100_000}, batch):
        cfg = config(**b)
        backend = HFBackend(tiny_qwen2(), cfg, CPU)
        m = train_on(trajs, backend, cfg)
        results.append((m, _grads(backend)))
    (m1, g1), (m2, g2) = results
    assert g1.abs().max() > 1e-3
    assert torch.allclose(g1, g2, atol=1e-7)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)


def test_minibatches_take_several_optimizer_steps() -> None:
    cfg = config(num_minibatches=2)
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    m = train_on(make_batch(2, 4), backend, cfg)
    assert m["optimizer_steps"] == 2
    assert backend.optimizer_steps == 2


def test_export_hf_loads_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    cfg = config()
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    train_on(make_batch(1, 4), backend, cfg)
    out = backend.export_hf(tmp_path / "export")
    assert out is not None and (out / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, backend.model(ids).logits, atol=1e-6)


def test_out_of_vocabulary_trajectories_are_dropped_and_counted() -> None:
    cfg = config()
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    trajs = make_batch(1, 4)
    trajs[0].response_token_ids[0] = 10_000
    m = train_on(trajs, backend, cfg)
    assert m["invalid_samples"] == 1 and m["samples"] == 3


def test_nan_rollout_logprobs_with_tis_never_make_the_loss_nan() -> None:
    cfg = config()
    cfg.tis.mode = "mis"  # type: ignore[assignment]
    trajs = make_batch(1, 4)
    for t in trajs:
        t.has_rollout_logprobs = True
        t.rollout_logprobs[:] = [-4.0] * len(t.rollout_logprobs)
    trajs[0].rollout_logprobs[0] = float("nan")
    trajs[1].rollout_logprobs[3] = float("-inf")
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    m = train_on(trajs, backend, cfg)
    assert m["nonfinite_rollout_logprobs"] == 2
    for key in ("loss", "pg_loss", "kl", "grad_norm", "tis/weight_mean"):
        assert math.isfinite(m[key]), key
    assert 0 < m["tis/effective_sample_size"] <= 1
    assert all(torch.isfinite(p).all() for p in backend.model.parameters())


def test_bf16_autocast_path_runs_with_fp32_master_weights() -> None:
    # The CUDA default; on CPU autocast covers the same code path.
    cfg = config()
    cfg.model.dtype = "bfloat16"  # type: ignore[assignment]
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    assert backend.compute_dtype == torch.bfloat16
    m = train_on(make_batch(1, 4), backend, cfg)
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in backend.model.parameters())


def test_degenerate_groups_are_counted_and_optionally_filtered() -> None:
    trajs = make_batch(2, 4)
    for t in trajs:
        if t.group_id == "g1":
            t.reward.total = 1.0  # all equal: no signal
    cfg = config()
    samples, adv, m = build_sequences(trajs, cfg)
    assert m["groups/degenerate"] == 1 and len(samples) == 8
    assert all(a == 0.0 for s, a in zip(samples, adv.tolist(), strict=True) if s.group_id == "g1")
    cfg.advantages.filter_degenerate_groups = True
    samples, adv, m = build_sequences(trajs, cfg)
    assert {s.group_id for s in samples} == {"g0"} and len(adv) == 4
    assert m["samples"] == 4 and m["reward/mean"] == pytest.approx(0.75)  # stats before filtering


def test_warmup_counts_training_steps_not_optimizer_steps() -> None:
    # warmup_steps 4 training steps, 2 optimizer steps each: the LR of training step s is
    # lr * (s + 1) / 4 for both of its optimizer steps, then lr from training step 3 on.
    cfg = config(num_minibatches=2)
    cfg.optim.schedule = "warmup"  # type: ignore[assignment]
    cfg.optim.warmup_steps = 4
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    used: list[float] = []
    backend.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"])
    )
    reported = [train_on(make_batch(2, 4), backend, cfg)["lr"] for _ in range(5)]
    lr = 1e-2
    per_opt = [0.25, 0.25, 0.5, 0.5, 0.75, 0.75, 1.0, 1.0, 1.0, 1.0]
    assert used == pytest.approx([lr * f for f in per_opt])
    assert backend.optimizer_steps == 10
    # The metric is the LR the step trained with, not the next one.
    assert reported == pytest.approx([lr * f for f in (0.25, 0.5, 0.75, 1.0, 1.0)])


@pytest.mark.parametrize("policy", [Policy.CURRENT, Policy.REFERENCE])
def test_old_and_ref_logprobs_ignore_dropout_after_a_step(policy: Policy) -> None:
    # Attention dropout 0.5: in train() mode two forwards of the same batch differ.
    cfg = config()
    backend = HFBackend(tiny_qwen2(attention_dropout=0.5), cfg, CPU)
    trajs = make_batch(1, 4)
    train_on(trajs, backend, cfg)
    runs = []
    for _ in range(2):
        samples, _, _ = build_sequences(trajs, cfg)
        runs.append(torch.cat(sequence_logprobs(samples, backend, policy, cfg)))
    assert torch.equal(runs[0], runs[1]), float((runs[0] - runs[1]).abs().max())
    # One step (one micro-batch each): the old-logprob pass in eval(), the loss pass in train().
    modes: list[bool] = []
    attn = backend.model.model.layers[0].self_attn
    attn.register_forward_pre_hook(lambda m, args: modes.append(m.training))
    train_on(trajs, backend, cfg)
    assert modes == [False, True]


def test_logprobs_sent_to_other_ranks_carry_only_their_own_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rank all-gathers its sequences' logprobs by pickling them. A view pickles its
    whole storage, so per-sequence views of a micro-batch's (or a pass's) logprobs sent
    every sequence the storage of all of them: O(sequences x tokens) bytes per rank."""
    import pickle

    cfg = config(max_tokens_per_microbatch=4096)
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    seqs, _, _ = build_sequences(make_batch(2, 4), cfg)
    sent: list[object] = []

    def gather(obj: object) -> list[object]:
        sent.append(obj)
        return [obj]

    monkeypatch.setattr(backend, "all_gather_dp", gather)
    got = sequence_logprobs(seqs, backend, Policy.CURRENT, cfg)
    (local,) = sent
    tokens = sum(s.response_len for s in seqs)
    assert sum(t.numel() for t in got) == tokens
    own = {i: t.clone() for i, t in local.items()}  # type: ignore[attr-defined]
    assert len(pickle.dumps(local)) == len(pickle.dumps(own))
