"""`trainer.logprobs.head_token_stats`: logprobs and entropies in chunks of tokens, against the
full fp32 logits (values and gradients within 1e-5), a hand-computed case, vocabulary padding,
and the vocabulary split over two gloo ranks as tensor parallelism splits it."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.logprobs import head_token_stats
from trainer.losses import entropy_from_logits


def _full(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    z = (hidden @ weight.T).float() / temps[:, None]
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return logp, entropy_from_logits(z)


def _inputs(n: int = 37, h: int = 16, v: int = 53, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(v, h, generator=g).mul(0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    temps = torch.rand(n, generator=g) + 0.5
    return hidden, weight, targets, temps


def test_a_hand_computed_case() -> None:
    # One token, hidden [1, 0], head rows give logits [0, ln 2, ln 3] at t = 1: p = [1, 2, 3]/6.
    hidden = torch.tensor([[1.0, 0.0]])
    weight = torch.tensor([[0.0, 0.0], [math.log(2), 0.0], [math.log(3), 0.0]])
    logp, ent = head_token_stats(
        hidden, weight, torch.tensor([2]), torch.ones(1), chunk=1, compute_dtype=torch.float32
    )
    p = [1 / 6, 2 / 6, 3 / 6]
    assert logp.item() == pytest.approx(math.log(0.5), abs=1e-6)
    assert ent.item() == pytest.approx(-sum(x * math.log(x) for x in p), abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
def test_values_and_gradients_equal_the_full_logits(chunk: int) -> None:
    hidden, weight, targets, temps = _inputs()
    gl, ge = torch.randn(37), torch.randn(37)
    ref_lp, ref_ent = _full(hidden, weight, targets, temps)
    ((ref_lp * gl).sum() + (ref_ent * ge).sum()).backward()
    ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()  # type: ignore[union-attr]
    hidden.grad = weight.grad = None
    lp, ent = head_token_stats(
        hidden, weight, targets, temps, chunk=chunk, compute_dtype=torch.float32
    )
    ((lp * gl).sum() + (ent * ge).sum()).backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    # Gradients sum over the 37 tokens: 1e-5 relative too (fp32 rounding of sums near 4).
    torch.testing.assert_close(hidden.grad, ref_gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, ref_gw, atol=1e-5, rtol=1e-5)


def test_a_detached_entropy_or_logprob_needs_no_gradient_of_it() -> None:
    hidden, weight, targets, temps = _inputs()
    ref_lp, _ = _full(hidden, weight, targets, temps)
    ref_lp.sum().backward()
    ref_gh = hidden.grad.clone()  # type: ignore[union-attr]
    hidden.grad = weight.grad = None
    lp, ent = head_token_stats(hidden, weight, targets, temps, chunk=5, compute_dtype=torch.float32)
    (lp.sum() + ent.detach().sum()).backward()
    torch.testing.assert_close(hidden.grad, ref_gh, atol=1e-5, rtol=0)


def test_padded_vocabulary_rows_are_ignored() -> None:
    hidden, weight, targets, temps = _inputs(v=50)
    padded = torch.cat([weight.detach(), torch.randn(6, weight.shape[1])]).requires_grad_()
    ref_lp, ref_ent = _full(hidden, weight, targets, temps)
    lp, ent = head_token_stats(
        hidden, padded, targets, temps, chunk=7, compute_dtype=torch.float32, vocab_size=50
    )
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(padded.grad).all()  # type: ignore[arg-type]
    assert padded.grad[50:].abs().max() == 0  # type: ignore[index]


def test_bad_chunk_is_refused() -> None:
    hidden, weight, targets, temps = _inputs()
    with pytest.raises(ValueError, match="chunk"):
        head_token_stats(hidden, weight, targets, temps, chunk=0, compute_dtype=torch.float32)


def _tp_rank(rank: int, port: int, out: dict) -> None:  # type: ignore[type-arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        hidden, weight, targets, temps = _inputs(v=50)
        gl, ge = torch.randn(37, generator=torch.Generator().manual_seed(1)), torch.ones(37)
        # Vocabulary 50 padded to 56, 28 rows per rank (the second rank holds the 6 pad rows).
        padded = torch.cat([weight.detach(), torch.zeros(6, weight.shape[1])])
        mine = padded[rank * 28 : (rank + 1) * 28].clone().requires_grad_()
        lp, ent = head_token_stats(
            hidden,
            mine,
            targets,
            temps,
            chunk=9,
            compute_dtype=torch.float32,
            vocab_start=rank * 28,
            vocab_size=50,
            group=dist.group.WORLD,
        )
        ((lp * gl).sum() + (ent * ge).sum()).backward()
        out[rank] = (lp.detach(), ent.detach(), hidden.grad, mine.grad)
    finally:
        dist.destroy_process_group()


def test_the_vocabulary_split_over_two_ranks_gives_the_full_result() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.start_processes(_tp_rank, args=(port, out), nprocs=2, start_method="fork")
    hidden, weight, targets, temps = _inputs(v=50)
    gl, ge = torch.randn(37, generator=torch.Generator().manual_seed(1)), torch.ones(37)
    ref_lp, ref_ent = _full(hidden, weight, targets, temps)
    ((ref_lp * gl).sum() + (ref_ent * ge).sum()).backward()
    for rank in (0, 1):
        lp, ent, gh, gw = out[rank]
        torch.testing.assert_close(lp, ref_lp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(gh, hidden.grad, atol=1e-5, rtol=1e-5)
        ref_slice = torch.cat([weight.grad, torch.zeros(6, 16)])[rank * 28 : (rank + 1) * 28]  # type: ignore[list-item]
        torch.testing.assert_close(gw, ref_slice, atol=1e-5, rtol=1e-5)


def test_to_host_returns_each_micro_batch_in_order() -> None:
    from trainer.logprobs import to_host

    parts = [torch.tensor([1.0, 2.0]), torch.zeros(0), torch.tensor([[3.0], [4.0]])]
    got = to_host(parts)
    assert [p.tolist() for p in got] == [[1.0, 2.0], [], [3.0, 4.0]]
    assert all(p.device.type == "cpu" for p in got)
    # each its own storage: pickled (a pipeline stage's broadcast), a view carries them all
    assert [p.untyped_storage().nbytes() for p in got] == [8, 0, 8]
    assert to_host([]) == []
