"""One GRPO step of a real model shape at the slime recipe's batch, per trainer backend.

    python bench/trainer_step.py [--shape qwen2.5-3b|tiny] [--samples 256] [--budget 8192]
                                 [--backends hf,megatron] [--repeats 2] [--device cuda]
                                 [--kl-coef 0.001] [--recompute none|attention|full]
                                 [--logprob-chunk 1024] [--profile DIR]
                                 [--attention varlen|per-sequence]
                                 [--old-logprobs recompute|forward]

Random weights in the shape's Hugging Face config (Qwen2.5-3B: 36 layers, hidden 2048, GQA
16/2, vocabulary 151,936, tied embeddings), a rollout batch of `--samples` Search-R1-shaped
trajectories (`bench/trainer.py`'s length spread: ~1,000 tokens each), and one full training
step of the GRPO core (`trainer.step.train_on`): old-logprob recompute, the reference forward
(when `--kl-coef` > 0), forward/backward over packed micro-batches of `--budget` tokens, the
optimizer step. Slime's 3B recipe: 32 prompts x 8 samples, KL 0.001 (its full recompute is
`--recompute full`; the default keeps every activation).

Each timed step trains on a new batch (new sequence lengths, as in a run). Per backend, of
the fastest step: tokens/s, the step's seconds (and its logprob / forward-backward / optimizer
parts), the peak GPU memory, and MFU: model FLOPs (the matmuls and causal attention of every
forward the step needs, x3 for the one with a backward; gradient-checkpoint recompute not
counted, as usual) over the step's seconds and the GPU's dense bf16 peak (`--peak-tflops`,
989 for an H100 SXM). `--shape tiny` runs anywhere (the CPU check of this script).

The last line is key=value pairs.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.trainer import batch

# Hugging Face config fields of each shape (`tiny`: a few seconds on a CPU).
SHAPES: dict[str, dict[str, object]] = {
    "qwen2.5-3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}


def hf_model(shape: str, device: torch.device):  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with device:  # random init on the device: seconds for 3B on a GPU, minutes on a CPU
        return Qwen2ForCausalLM(cfg)


def forward_flops(cfg, lengths: list[int]) -> float:  # type: ignore[no-untyped-def]
    """Matmul FLOPs of one forward over sequences of `lengths` (2 per multiply-add): the
    projections, the MLP and the LM head per token, causal attention per sequence."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    hd = h // cfg.num_attention_heads
    q = cfg.num_attention_heads * hd
    kv = cfg.num_key_value_heads * hd
    per_layer = h * (2 * q + 2 * kv) + 3 * h * cfg.intermediate_size
    per_token = 2 * (layers * per_layer + h * cfg.vocab_size)
    # QK^T and AV over the causal half: 2 matmuls x 2 FLOPs x n^2/2 x q per layer.
    attention = sum(2 * layers * n * n * q for n in lengths)
    return per_token * sum(lengths) + attention


def run_backend(name: str, args: argparse.Namespace) -> dict[str, float]:
    from trainer.config import TrainerConfig
    from trainer.dist import DistInfo
    from trainer.step import train_on

    dev = torch.device(args.device)
    cfg = TrainerConfig(
        backend=name,
        model={
            "device": args.device,
            "recompute": args.recompute,
            "logprob_chunk_tokens": args.logprob_chunk,
        },
        optim={"lr": 1e-6, "betas": (0.9, 0.98), "weight_decay": 0.01, "grad_clip": 1.0},
        loss={
            "kl_coef": args.kl_coef,
            "aggregation": "sample_mean",
            "old_logprobs": args.old_logprobs,
        },
        tis={"mode": "token", "cap": 2.0},
        batch={"max_tokens_per_microbatch": args.budget},
    )
    info = DistInfo(0, 1, 0, dev)
    t0 = time.perf_counter()
    hf = hf_model(args.shape, dev)
    hf_cfg = hf.config
    if name == "megatron":
        from trainer.backends.megatron.backend import MegatronBackend

        state = dict(hf.state_dict())
        del hf
        backend = MegatronBackend(state, hf_cfg, cfg, info)
        del state
    else:
        from trainer.backends.hf import HFBackend

        backend = HFBackend(hf, cfg, info)
        del hf
    gc.collect()
    build_s = time.perf_counter() - t0
    # A new batch per step, as in a run: new sequence lengths each time (kernels that plan per
    # shape pay for it every step, not only in the first).
    warm = batch(max(args.samples // 8, 1), hf_cfg.vocab_size, seed=1000)
    train_on(warm, backend, cfg)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    # The forward-only passes the step needs: old logprobs (unless the training forward's
    # own are used, `--old-logprobs forward`) and the reference.
    forwards_only = (args.old_logprobs == "recompute") + (args.kl_coef > 0)
    metrics: list[dict[str, float]] = []
    seconds: list[float] = []
    flops: list[float] = []
    tokens: list[int] = []
    for r in range(args.repeats):
        trajs = batch(args.samples, hf_cfg.vocab_size, seed=r)
        lengths = [len(t.prompt_token_ids) + len(t.response_token_ids) for t in trajs]
        t0 = time.perf_counter()
        metrics.append(train_on(trajs, backend, cfg))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        flops.append(forward_flops(hf_cfg, lengths) * (3 + forwards_only))
        tokens.append(sum(lengths))
        print(f"{name} step {r}: {seconds[-1]:.2f} s, {tokens[-1]} tokens", flush=True)
    fastest = seconds.index(min(seconds))
    best = metrics[fastest]
    step_s, flops_s = seconds[fastest], flops[fastest] / seconds[fastest]
    out = {
        "tokens_per_s": round(tokens[fastest] / step_s),
        "step_s": round(step_s, 2),
        "step_s_max": round(max(seconds), 2),
        "logprobs_s": round(best["time/logprobs_s"], 2),
        "forward_backward_s": round(best["time/forward_backward_s"], 2),
        "optimizer_s": round(best["time/optimizer_s"], 2),
        "build_s": round(build_s, 1),
        "tflops": round(flops_s / 1e12, 1),
    }
    if dev.type == "cuda":
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        out["mfu"] = round(flops_s / (args.peak_tflops * 1e12), 3)
    print(f"backend {name}: " + " ".join(f"{k}={v}" for k, v in out.items()), flush=True)
    if args.profile:
        out |= profile_passes(name, backend, cfg, hf_cfg.vocab_size, Path(args.profile))
    del backend
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def profile_passes(name: str, backend, cfg, vocab: int, out: Path) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Where a step's time goes: torch.profiler over each forward-only pass (current policy,
    reference) and one forward + backward, each on the micro-batches of 16 new samples. The
    top operators by device time go to `out/profile-<backend>-<pass>.txt`; whether the device
    was kept busy and what made the host wait (`bench.profile_summary`) is printed and
    returned as `<pass>_<key>` pairs."""
    from torch.profiler import ProfilerActivity, profile

    from bench.profile_summary import summarize
    from trainer.backend import Policy
    from trainer.losses import LossTerms
    from trainer.step import build_sequences, rank_microbatches

    out.mkdir(parents=True, exist_ok=True)
    # Two 8,192-token micro-batches: the gap between them shows, the trace stays small.
    seqs = build_sequences(batch(16, vocab, seed=2000), cfg)[0]
    mbs = rank_microbatches(seqs, backend, cfg)
    cuda = torch.cuda.is_available()

    def fwd_bwd() -> None:
        backend.forward_backward(
            mbs, lambda mb, lp, ent: LossTerms(loss=lp.sum(), metrics={}), entropy_grad=False
        )

    passes = {
        "logprobs_current": lambda: backend.logprobs(mbs, Policy.CURRENT),
        "logprobs_reference": lambda: backend.logprobs(mbs, Policy.REFERENCE),
        "train": fwd_bwd,
    }
    if cfg.loss.kl_coef <= 0:  # no reference model
        del passes["logprobs_reference"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    found: dict[str, float] = {}

    def timed(run: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def alloc_retries() -> int:
        return torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0

    for what, run in passes.items():
        timed(run)  # warm
        retries = alloc_retries()
        plain_s = timed(run)  # the profiler's own per-operator cost inflates the wall time
        retries = alloc_retries() - retries
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            run()
            if cuda:
                torch.cuda.synchronize()
            wall_s = time.perf_counter() - t0
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        (out / f"profile-{name}-{what}.txt").write_text(table)
        summary = summarize(prof.events(), wall_s, plain_s) | {"alloc_retries": float(retries)}
        print(f"profile {name} {what}:\n" + "\n".join(table.splitlines()[:16]), flush=True)
        print(
            f"profile backend={name} pass={what} "
            + " ".join(f"{k}={v}" for k, v in summary.items()),
            flush=True,
        )
        found |= {f"{what}_{k}": v for k, v in summary.items()}
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-3b")
    ap.add_argument("--samples", type=int, default=256, help="32 prompts x 8 (slime's 3B)")
    ap.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch")
    ap.add_argument("--backends", default="hf,megatron")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kl-coef", type=float, default=0.001)
    ap.add_argument("--recompute", default="none", choices=["none", "attention", "full"])
    ap.add_argument("--logprob-chunk", type=int, default=1024, help="0: full fp32 logits")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak")
    ap.add_argument("--profile", default="", help="a folder: profile each backend's passes")
    ap.add_argument(
        "--old-logprobs",
        default="recompute",
        choices=["recompute", "forward"],
        help="loss.old_logprobs: forward takes them from the training forward (one pass less)",
    )
    ap.add_argument(
        "--attention",
        default="varlen",
        choices=["varlen", "per-sequence"],
        help="per-sequence: the pre-issue-31 attention on CUDA too (a baseline on the same card)",
    )
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if args.attention == "per-sequence":
        import trainer.attention

        trainer.attention.flash_varlen_applies = lambda query, dropout: False
    kv: dict[str, object] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "shape": args.shape,
        "samples": args.samples,
        "budget": args.budget,
        "recompute": args.recompute,
        "logprob_chunk": args.logprob_chunk,
        "attention": args.attention,
        "old_logprobs": args.old_logprobs,
    }
    for name in args.backends.split(","):
        for k, v in run_backend(name, args).items():
            kv[f"{name}_{k}"] = v
    print(" ".join(f"{k}={str(v).replace(' ', '_')}" for k, v in kv.items()))


if __name__ == "__main__":
    main()
