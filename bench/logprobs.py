"""Peak memory and time of token logprobs + entropy (forward and backward) from the last hidden
states: full fp32 logits vs `trainer.logprobs.head_token_stats` in chunks of tokens.

    python -P bench/logprobs.py [--tokens 4096] [--hidden 2048] [--vocab 151936]
                                [--chunk 1024] [--device cuda|cpu] [--dtype bfloat16|float32]

Qwen2.5-3B's head by default (hidden 2048, vocabulary 151,936). Each variant runs in a
process of its own; peak memory above the inputs is `torch.cuda.max_memory_allocated` on CUDA
and the growth of the peak resident set (ru_maxrss) on CPU. The last line is key=value pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch


def _full(hidden, weight, targets, dtype):  # type: ignore[no-untyped-def]
    from trainer.losses import entropy_from_logits

    z = (hidden.to(dtype) @ weight.to(dtype).T).float()
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return logp, entropy_from_logits(z)


def _variant(args: argparse.Namespace) -> dict[str, float]:
    from trainer.logprobs import head_token_stats

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype, requires_grad=True)
    weight = torch.randn(args.vocab, args.hidden, device=dev, dtype=dtype).mul_(0.02)
    weight.requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    temps = torch.ones(args.tokens)
    weight.grad = torch.zeros_like(weight)  # the gradient buffers exist in training anyway
    hidden.grad = torch.zeros_like(hidden)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if args.variant == "full":
        logp, ent = _full(hidden, weight, targets, dtype)
    else:
        logp, ent = head_token_stats(
            hidden, weight, targets, temps, chunk=args.chunk, compute_dtype=dtype
        )
    (logp.sum() + 0.01 * ent.sum()).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    return {"peak_mib": round(peak / 2**20, 1), "seconds": round(seconds, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternated")
    ap.add_argument("--variant", choices=["full", "chunked"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.variant:  # a child: one variant, one JSON line
        print(json.dumps(_variant(args)))
        return
    runs: dict[str, list[dict[str, float]]] = {"full": [], "chunked": []}
    for _ in range(args.repeats):
        for variant in runs:  # alternated: A B A B
            cmd = [sys.executable, "-P", __file__, "--variant", variant]
            for k in ("tokens", "hidden", "vocab", "chunk", "device", "dtype"):
                cmd += [f"--{k}", str(getattr(args, k))]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
            print(variant, runs[variant][-1], flush=True)
    kv: dict[str, object] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "tokens": args.tokens,
        "vocab": args.vocab,
        "chunk": args.chunk,
        "dtype": args.dtype,
    }
    for variant, rs in runs.items():
        kv[f"{variant}_peak_mib"] = max(r["peak_mib"] for r in rs)
        kv[f"{variant}_s"] = min(r["seconds"] for r in rs)
    kv["peak_ratio"] = round(kv["full_peak_mib"] / max(kv["chunked_peak_mib"], 1e-9), 2)  # type: ignore[operator]
    print(" ".join(f"{k}={str(v).replace(' ', '_')}" for k, v in kv.items()))


if __name__ == "__main__":
    main()
