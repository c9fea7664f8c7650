"""The trainer's logprobs are those of the sampling distribution: logits / T, per sample.

The engine (SGLang, and our reference engine) returns log_softmax(logits / T) for the tokens it
samples at temperature T, so the trainer's current, old and reference logprobs and its entropy
must be of the same distribution, per sample even inside one packed row.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.trainer.conftest import make_trajectory, tiny_qwen2
from trainer.backend import Policy
from trainer.backends.hf import HFBackend
from trainer.batching import TrainSequence, build_microbatch, sequence_from_trajectory
from trainer.config import BatchConfig, LossConfig, TrainerConfig
from trainer.dist import DistInfo
from trainer.losses import entropy_from_logits
from trainer.step import rank_microbatches, sequence_logprobs

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def sample(tid: str, temperature: float, seed: int, response_len: int = 7) -> TrainSequence:
    t = make_trajectory(tid, "g", 0.0, prompt_len=5, response_len=response_len, seed=seed)
    t.temperature = temperature
    s, _ = sequence_from_trajectory(t)
    return s


def teacher_forced(model: torch.nn.Module, s: TrainSequence, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, one sequence alone (no packing)."""
    with torch.no_grad():
        logits = model(torch.as_tensor(s.input_ids)[None]).logits[0].float()
    rows = logits[s.prompt_len - 1 : s.length - 1] / temperature
    return torch.log_softmax(rows, -1).gather(
        -1, torch.as_tensor(s.input_ids[s.prompt_len :])[:, None]
    )[:, 0]


def backend(*, packing: bool = True, kl_coef: float = 0.0) -> HFBackend:
    cfg = TrainerConfig(
        loss=LossConfig(kl_coef=kl_coef, entropy_coef=0.001), batch=BatchConfig(packing=packing)
    )
    return HFBackend(tiny_qwen2(), cfg, CPU)


def test_sample_temperature_from_trajectory() -> None:
    assert sample("a", 0.7, 0).temperature == pytest.approx(0.7)
    assert sample("b", 1.3, 0).temperature == pytest.approx(1.3)
    # Greedy (0), or a producer without the field: temperature-1 logprobs, as SGLang's greedy.
    assert sample("c", 0.0, 0).temperature == 1.0
    assert sample("d", 1e-7, 0).temperature == 1.0  # below SGLang's greedy epsilon


def test_logprobs_at_07_are_log_softmax_of_logits_over_07() -> None:
    b = backend(kl_coef=0.01)
    [s] = samples = [sample("a", 0.7, seed=1)]
    [old] = sequence_logprobs(samples, b, Policy.CURRENT, b.cfg)
    [ref] = sequence_logprobs(samples, b, Policy.REFERENCE, b.cfg)
    want = teacher_forced(b.model, s, 0.7)
    torch.testing.assert_close(old, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=0)
    # Temperature 1 would be far off: the check above tells the two apart.
    assert float((old - teacher_forced(b.model, s, 1.0)).abs().max()) > 1e-2


def test_hand_checked_logprob_of_one_token() -> None:
    b = backend()
    [s] = samples = [sample("a", 0.7, seed=2, response_len=1)]
    [old] = sequence_logprobs(samples, b, Policy.CURRENT, b.cfg)
    with torch.no_grad():
        z = b.model(torch.as_tensor(s.input_ids)[None]).logits[0, s.prompt_len - 1].double()
    target = s.input_ids[s.prompt_len]
    # log p = z_t / T - log(sum_v exp(z_v / T)), written out.
    hand = float(z[target] / 0.7 - torch.log(torch.exp(z / 0.7).sum()))
    assert float(old[0]) == pytest.approx(hand, abs=1e-5)


@pytest.mark.parametrize("packing", [True, False])
def test_batch_mixing_temperatures_is_right_per_sample(packing: bool) -> None:
    b = backend(packing=packing)
    samples = [
        sample("a", 0.7, seed=3, response_len=6),
        sample("b", 1.3, seed=4, response_len=9),
        sample("c", 0.0, seed=5, response_len=4),  # greedy: temperature 1
    ]
    olds = sequence_logprobs(samples, b, Policy.CURRENT, b.cfg)
    for s, old, temp in zip(samples, olds, (0.7, 1.3, 1.0), strict=True):
        torch.testing.assert_close(old, teacher_forced(b.model, s, temp), atol=1e-5, rtol=0)
    mb = build_microbatch(samples, [0, 1, 2], packed=packing)
    assert mb.temperatures.tolist() == pytest.approx([0.7] * 6 + [1.3] * 9 + [1.0] * 4)
    # The plan really packed them into one micro-batch.
    assert len(rank_microbatches(samples, b, b.cfg)) == 1


def test_entropy_is_of_the_tempered_distribution() -> None:
    b = backend()
    samples = [sample("a", 0.7, seed=6, response_len=5), sample("b", 1.3, seed=7, response_len=3)]
    mb = build_microbatch(samples, [0, 1], packed=True)
    logp, ent = b._forward(b.model, mb, with_entropy=True)
    assert ent is not None
    want = []
    for s, temp in zip(samples, (0.7, 1.3), strict=True):
        with torch.no_grad():
            logits = b.model(torch.as_tensor(s.input_ids)[None]).logits[0].float()
        want.append(entropy_from_logits(logits[s.prompt_len - 1 : s.length - 1] / temp))
    torch.testing.assert_close(ent.detach(), torch.cat(want), atol=1e-5, rtol=0)
    # The loss path sees the same logprobs as the no-grad one.
    torch.testing.assert_close(
        logp.detach(),
        torch.cat(
            [teacher_forced(b.model, s, t) for s, t in zip(samples, (0.7, 1.3), strict=True)]
        ),
        atol=1e-5,
        rtol=0,
    )
