"""Run under torchrun by the Megatron tests: the Megatron backend against the HF backend.

Megatron-Core keeps global process-group state and the CPU shims patch `torch.cuda`, so every
Megatron check runs in its own processes, never in the pytest process. Each rank builds the
same tiny random Qwen2 (seeded), an HF backend alone (world size 1) as the reference, and the
Megatron backend over all ranks; a failed check raises (non-zero exit). Rank 0 writes the
measured differences as JSON to argv[-1].

The device and dtype come from `SEARCHR1_TEST_DEVICE` (cpu) and `SEARCHR1_TEST_DTYPE`
(float32), the tolerance of the checked differences from `SEARCHR1_TEST_TOL` (1e-5): the GPU
tests (tests/gpu) run the same checks on CUDA, in fp32 and in bf16.

    torchrun --nproc-per-node N worker.py TP PP TIED OUT.json

With one rank it also checks that `recompute: full` changes no gradient (`recompute`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from tests.unit.trainer.conftest import make_batch, tiny_qwen2  # noqa: E402
from trainer.backend import Policy  # noqa: E402
from trainer.batching import build_microbatch, sequence_from_trajectory  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.dist import DistInfo, close_distributed  # noqa: E402
from trainer.losses import LossTerms  # noqa: E402

DEVICE = torch.device(os.environ.get("SEARCHR1_TEST_DEVICE", "cpu"))
DTYPE = os.environ.get("SEARCHR1_TEST_DTYPE", "float32")
TOL = float(os.environ.get("SEARCHR1_TEST_TOL", "1e-5"))
# The keys of differences that must stay within TOL (the rest are values, for the report).
CHECKED = ("gather", "logprobs_", "entropy", "metric_", "weights", "resume")


def hf_reference(model, seqs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Per sequence, one at a time: log_softmax(logits / T)[target] and the entropy."""
    lps, ents = [], []
    dev = next(model.parameters()).device
    with torch.no_grad():
        for s in seqs:
            ids = torch.as_tensor(s.input_ids, device=dev)[None]
            logits = model(ids).logits[0].float() / s.temperature
            rows = logits[s.prompt_len - 1 : s.length - 1]
            logp = torch.log_softmax(rows, -1)
            lps.append(logp.gather(-1, ids[0, s.prompt_len :, None])[:, 0].cpu())
            ents.append(-(logp.exp() * logp).sum(-1).cpu())
    return lps, ents


def recompute() -> None:
    """`trainer.model.recompute` (Megatron's selective `core_attn` and full) changes no
    gradient."""
    from trainer.backends.megatron.backend import MegatronBackend

    hf = tiny(False)
    seqs = [sequence_from_trajectory(t)[0] for t in make_batch(1, 3, seed=1)]
    mb = build_microbatch(seqs, [0, 1, 2], packed=True)
    grads = []
    for mode in ("none", "attention", "full"):
        cfg = TrainerConfig(
            backend="megatron", loss={"kl_coef": 0.0}, model={"recompute": mode, "dtype": DTYPE}
        )
        state = {k: v.clone() for k, v in hf.state_dict().items()}
        meg = MegatronBackend(state, hf.config, cfg, DistInfo(0, 1, 0, DEVICE))
        meg.forward_backward(
            [mb], lambda mb, lp, ent: LossTerms(loss=lp.sum(), metrics={}), entropy_grad=False
        )
        grads.append({n: p.main_grad.clone() for n, p in meg.ddp.module.named_parameters()})
    for name, g in grads[0].items():
        assert g.abs().max() > 0, name
        for other in grads[1:]:
            assert torch.equal(g, other[name]), name


def main() -> None:
    tp, pp, tied, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    from trainer.backends.hf import HFBackend
    from trainer.backends.megatron.backend import MegatronBackend

    cfg = TrainerConfig(
        backend="megatron",
        megatron={"tp": tp, "pp": pp},
        model={"dtype": DTYPE},
        optim={"lr": 1e-3, "grad_clip": 1.0},
        loss={"kl_coef": 0.01, "entropy_coef": 0.01},
        batch={"max_tokens_per_microbatch": 48},
    )
    hf = tiny(tied)
    meg = MegatronBackend(
        {k: v.clone() for k, v in hf.state_dict().items()},
        hf.config,
        cfg,
        DistInfo(rank, world, rank, DEVICE),
    )
    ref = HFBackend(hf, cfg, DistInfo(0, 1, 0, DEVICE))
    # What a weight push sends: the gathered shards in HF names, bit-exact before training.
    pushed = {k: v.cpu() for k, v in meg.named_tensors()}
    diffs: dict[str, float] = {}
    if rank == 0:
        want0 = tiny(tied).state_dict()
        assert set(pushed) == set(want0), set(pushed) ^ set(want0)
        diffs["gather_initial"] = max(float((pushed[k] - want0[k]).abs().max()) for k in want0)
    else:
        assert not pushed
    trajs = make_batch(n_groups=2, group_size=4, seed=1)
    for k, t in enumerate(trajs):
        t.temperature = (0.7, 1.0, 1.3)[k % 3]
        t.has_rollout_logprobs = True  # for the trainer-vs-rollout metric of both sources
        t.rollout_logprobs[:] = [-4.5 - 0.01 * j for j in range(len(t.rollout_logprobs))]
    seqs = [sequence_from_trajectory(t)[0] for t in trajs]

    # Logprobs and entropy: packed micro-batches (3 sequences per row), this DP rank's share.
    plan = [list(range(i, min(i + 3, len(seqs)))) for i in range(0, len(seqs), 3)]
    mine = plan[meg.dp_rank :: meg.dp_size]
    mbs = [build_microbatch(seqs, idxs, packed=True) for idxs in mine]
    want_lp, want_ent = hf_reference(ref.model, seqs)
    for policy in (Policy.CURRENT, Policy.REFERENCE):
        got = meg.logprobs(mbs, policy)
        for mb, lp in zip(mbs, got, strict=True):
            want = torch.cat([want_lp[i] for i in mb.samples])
            diffs[f"logprobs_{policy}"] = max(
                diffs.get(f"logprobs_{policy}", 0.0), float((lp.cpu() - want).abs().max())
            )
    # Right-padded micro-batches (`batch.packing: false`): the same logprobs.
    padded = [build_microbatch(seqs, idxs, packed=False) for idxs in mine]
    for mb, lp in zip(padded, meg.logprobs(padded, Policy.CURRENT), strict=True):
        want = torch.cat([want_lp[i] for i in mb.samples])
        diffs["logprobs_padded"] = max(
            diffs.get("logprobs_padded", 0.0), float((lp.cpu() - want).abs().max())
        )
    ents: list[torch.Tensor] = []

    def record(mb, logp, entropy):  # type: ignore[no-untyped-def]
        ents.append(entropy.detach().cpu())
        return LossTerms(loss=(logp * 0).sum() + entropy.sum() * 0, metrics={})

    meg.forward_backward(mbs, record, entropy_grad=True)
    if ents:  # the last pipeline stage
        for mb, ent in zip(mbs, ents, strict=True):
            want = torch.cat([want_ent[i] for i in mb.samples])
            diffs["entropy"] = max(diffs.get("entropy", 0.0), float((ent - want).abs().max()))

    # One GRPO step of the real core on both backends: the same metrics and weights.
    from trainer.step import train_on

    got_m = train_on(trajs, meg, cfg)
    want_m = train_on(trajs, ref, cfg)
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
        if key in want_m:
            diffs[f"metric_{key}"] = abs(got_m[key] - want_m[key])
            diffs[f"value_{key}"] = want_m[key]
    got_w = {k: v.cpu() for k, v in meg.named_tensors()}

    # `loss.old_logprobs: forward` (the pipeline's replay on the other stages included): the
    # update of `recompute` above, without the old-policy pass.
    fwd_cfg = cfg.model_copy(deep=True)
    fwd_cfg.loss.old_logprobs = "forward"  # type: ignore[assignment]
    fwd = MegatronBackend(
        {k: v.clone() for k, v in _initial(tied).items()},
        hf.config,
        fwd_cfg,
        DistInfo(rank, world, rank, DEVICE),
    )
    fwd_m = train_on(trajs, fwd, fwd_cfg)
    for key in ("loss", "logprob_diff/trainer_vs_rollout_abs_mean"):
        diffs[f"metric_forward_{key}"] = abs(fwd_m[key] - got_m[key])
    fwd_w = {k: v.cpu() for k, v in fwd.named_tensors()}
    if rank == 0:
        diffs["weights_forward"] = max(float((fwd_w[k] - got_w[k]).abs().max()) for k in got_w)
    del fwd

    # Resume: a fresh backend loading the full state continues bit-identically.
    state = meg.full_state()
    again = MegatronBackend(
        {k: v.clone() for k, v in tiny(tied).state_dict().items()},
        hf.config,
        cfg,
        DistInfo(rank, world, rank, DEVICE),
    )
    again.load_full_state(state if rank == 0 else None)
    more = make_batch(n_groups=2, group_size=4, seed=2)
    train_on(more, meg, cfg)
    train_on(more, again, cfg)
    w1, w2 = dict(meg.named_tensors()), dict(again.named_tensors())
    if rank == 0:
        diffs["resume"] = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
        diffs["steps_after_resume"] = float(again.optimizer_steps)
    if rank == 0:
        want_w = {k: v.cpu() for k, v in ref.model.state_dict().items()}
        assert set(got_w) == set(want_w), set(got_w) ^ set(want_w)
        diffs["weights"] = max(float((got_w[k] - want_w[k]).abs().max()) for k in want_w)
        moved = max(float((got_w[k] - hf_w).abs().max()) for k, hf_w in _initial(tied).items())
        diffs["moved"] = moved
        Path(out).write_text(json.dumps(diffs))
    if world == 1:
        recompute()
        diffs["recompute_checked"] = 1.0
        Path(out).write_text(json.dumps(diffs))
    bad = {k: v for k, v in diffs.items() if k.startswith(CHECKED) and not v <= TOL}
    if bad:
        raise SystemExit(f"rank {rank}: differences above {TOL}: {bad}")


def tiny(tied: bool):  # type: ignore[no-untyped-def]
    model = tiny_qwen2()
    if not tied:
        return model
    from transformers import Qwen2ForCausalLM

    model.config.tie_word_embeddings = True
    torch.manual_seed(0)
    return Qwen2ForCausalLM(model.config)


def _initial(tied: bool) -> dict[str, torch.Tensor]:
    return dict(tiny(tied).state_dict())


if __name__ == "__main__":
    main()
    close_distributed()
