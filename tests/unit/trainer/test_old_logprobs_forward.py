"""`loss.old_logprobs: forward`: with one optimizer step per rollout batch the old policy is the
current one, so the training forward's own logprobs (detached) replace the forward-only pass
that recomputed them. The update, the loss metrics and token TIS must be those of `recompute`;
only the pass goes."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from tests.unit.trainer.conftest import make_batch, tiny_qwen2
from trainer.backend import Policy
from trainer.backends.hf import HFBackend
from trainer.config import BatchConfig, LossConfig, OptimConfig, TISConfig, TrainerConfig
from trainer.dist import DistInfo
from trainer.step import train_on

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def config(old_logprobs: str, **tis: object) -> TrainerConfig:
    return TrainerConfig(
        optim=OptimConfig(lr=1e-2, grad_clip=1.0),
        loss=LossConfig(kl_coef=0.01, entropy_coef=0.001, old_logprobs=old_logprobs),  # type: ignore[arg-type]
        batch=BatchConfig(max_tokens_per_microbatch=60),  # several micro-batches
        tis=TISConfig(**tis),  # type: ignore[arg-type]
    )


def with_rollout_logprobs(seed: int = 3):  # type: ignore[no-untyped-def]
    """Rollout logprobs around the tiny model's (~-4.85): some TIS ratios above the cap."""
    rng = random.Random(seed)
    trajs = make_batch(2, 4)
    for t in trajs:
        t.has_rollout_logprobs = True
        t.rollout_logprobs[:] = [rng.uniform(-6.5, -4.0) for _ in t.rollout_logprobs]
    return trajs


def step(cfg: TrainerConfig, trajs) -> tuple[dict[str, float], torch.Tensor, list[Policy]]:  # type: ignore[no-untyped-def]
    backend = HFBackend(tiny_qwen2(), cfg, CPU)
    passes: list[Policy] = []
    logprobs = backend.logprobs

    def counted(mbs, policy):  # type: ignore[no-untyped-def]
        passes.append(policy)
        return logprobs(mbs, policy)

    backend.logprobs = counted  # type: ignore[method-assign]
    metrics = train_on(trajs, backend, cfg)
    grads = torch.cat([p.grad.flatten() for p in backend.model.parameters()])
    return metrics, grads, passes


def test_the_update_is_that_of_recomputed_old_logprobs_without_their_pass() -> None:
    trajs = make_batch(2, 4)
    m_re, g_re, passes_re = step(config("recompute"), trajs)
    m_fw, g_fw, passes_fw = step(config("forward"), trajs)
    assert passes_re == [Policy.CURRENT, Policy.REFERENCE]
    assert passes_fw == [Policy.REFERENCE]  # the old-policy pass is gone
    assert g_re.abs().max() > 1e-3
    torch.testing.assert_close(g_fw, g_re, atol=1e-6, rtol=0)
    for key in ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_fraction_high"):
        assert m_fw[key] == pytest.approx(m_re[key], abs=1e-6), key
    assert m_fw["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_token_tis_is_that_of_the_staged_weights() -> None:
    trajs = with_rollout_logprobs()
    m_re, g_re, _ = step(config("recompute", mode="token", cap=1.1), trajs)
    m_fw, g_fw, _ = step(config("forward", mode="token", cap=1.1), trajs)
    assert 0 < m_re["tis/clip_fraction"] < 1  # both sides of the cap are exercised
    torch.testing.assert_close(g_fw, g_re, atol=1e-6, rtol=0)
    for key in (
        "loss",
        "pg_loss",
        "tis/weight_mean",
        "tis/clip_fraction",
        "tis/effective_sample_size",
        "logprob_diff/trainer_vs_rollout_abs_mean",
    ):
        assert m_fw[key] == pytest.approx(m_re[key], abs=1e-6), key


def test_nonfinite_rollout_logprobs_weigh_nothing_in_either_source() -> None:
    trajs = with_rollout_logprobs()
    trajs[0].rollout_logprobs[0] = float("nan")
    trajs[2].rollout_logprobs[5] = float("-inf")
    m_re, g_re, _ = step(config("recompute", mode="token"), trajs)
    m_fw, g_fw, _ = step(config("forward", mode="token"), trajs)
    assert torch.isfinite(g_fw).all()
    torch.testing.assert_close(g_fw, g_re, atol=1e-6, rtol=0)
    assert m_fw["tis/effective_sample_size"] == pytest.approx(
        m_re["tis/effective_sample_size"], abs=1e-6
    )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"batch": {"num_minibatches": 2}}, "batch.num_minibatches"),
        ({"tis": {"mode": "mis"}}, "tis.mode"),
        ({"tis": {"mode": "token", "renormalize": True}}, "tis.renormalize"),
    ],
)
def test_what_needs_the_old_policy_before_the_update_is_refused(
    overrides: dict[str, dict[str, object]], field: str
) -> None:
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        TrainerConfig(loss={"old_logprobs": "forward"}, **overrides)  # type: ignore[arg-type]
