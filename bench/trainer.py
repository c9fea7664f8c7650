"""Trainer throughput per backend, packed vs padded, and weight-push time vs a raw broadcast.

    python bench/trainer.py [--samples 64] [--budget 4096] [--hidden 256] [--layers 4]
                            [--repeats 2] [--padded-mbs 4] [--device cpu|cuda] [--no-push]
                            [--backends hf,megatron]

1. Training tokens/s of one full GRPO step (old-logprob recompute + forward/backward +
   AdamW) on a rollout batch with a Search-R1 length spread (prompts 150-250 tokens; responses
   of 0-4 searches, each a generated turn plus a ~400-token observation, then an answer: ~50 to
   ~2,800 tokens, see `response_mask`), once with packed micro-batches and once with padded
   ones: (a) arrival order with `B * max_len <= budget` (our padded path, same budget), and
   (b) the usual padded trainer, `--padded-mbs` sequences per micro-batch padded to the longest.
   For each backend of `--backends` (`trainer.backend`; megatron: one process, TP = PP = DP =
   1, when megatron-core is installed), on the same model weights and the same batches.
2. Weight push: a reference inference engine process serving a model of the same shape gets
   the trainer's weights through `WeightPusher` (gloo, `searchr1.weightsync.sender.WeightSender`);
   compared with a raw `torch.distributed.broadcast` of the same number of bytes between two
   processes (the transport's ceiling). CPU only.

The last line is key=value pairs. The smallest run (both backends, then the push; about 15 s
on 2 cores): `python bench/trainer.py --samples 8 --hidden 64 --layers 1 --vocab 256
--repeats 1 --padded-mbs 2`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from protos.trajectory import SCHEMA_VERSION, Trajectory


def response_mask(rng: random.Random) -> list[int]:
    """A Search-R1 response: 0-4 searches, each a generated turn (30-200 tokens, mask 1) plus
    an observation of 3 passages (300-500 tokens, mask 0), then a final answer turn."""
    k = rng.choices([0, 1, 2, 3, 4], weights=[20, 40, 25, 10, 5])[0]
    mask: list[int] = []
    for _ in range(k):
        mask += [1] * rng.randint(30, 200) + [0] * rng.randint(300, 500)
    return mask + [1] * rng.randint(20, 150)


def batch(n: int, vocab: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(150, 250)
        mask = response_mask(rng)
        t = Trajectory(
            schema_version=SCHEMA_VERSION,
            trajectory_id=f"b{i}",
            group_id=f"g{i // 8}",
            group_size=8,
            prompt_token_ids=[rng.randrange(vocab) for _ in range(p)],
            response_token_ids=[rng.randrange(vocab) for _ in range(len(mask))],
            loss_mask=bytes(mask),
            rollout_logprobs=[-2.0 * m for m in mask],
            has_rollout_logprobs=True,
        )
        t.reward.total = float(rng.random() < 0.5)
        out.append(t)
    return out


def model(hidden: int, layers: int, vocab: int):  # type: ignore[no-untyped-def]
    from transformers import Qwen2ForCausalLM

    from inference.tiny_model import qwen2_config

    torch.manual_seed(0)
    cfg = qwen2_config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=max(hidden // 64, 1),
        num_kv_heads=max(hidden // 128, 1),
    )
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg)


def make_backend(name: str, cfg, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The `trainer.backend` named `name` over the same seeded model (one process)."""
    from trainer.dist import DistInfo

    dev = torch.device("cuda" if args.device == "cuda" else "cpu")
    info = DistInfo(0, 1, 0, dev)
    hf = model(args.hidden, args.layers, args.vocab)
    if name == "megatron":
        from trainer.backends.megatron.backend import MegatronBackend

        state = {k: v.clone() for k, v in hf.state_dict().items()}
        return MegatronBackend(state, hf.config, cfg, info)
    from trainer.backends.hf import HFBackend

    return HFBackend(hf, cfg, info)


def train_rate(
    args: argparse.Namespace, backend_name: str = "hf", **batch_kw: object
) -> tuple[float, float, int, float]:
    """Best-of-repeats tokens/s by wall clock, the step's seconds, padded slots, and tokens per
    CPU-second of this process (single-threaded: robust when other jobs share the cores)."""
    from trainer.config import BatchConfig, LossConfig, ModelConfig, OptimConfig, TrainerConfig
    from trainer.step import train_on

    cfg = TrainerConfig(
        backend=backend_name,
        model=ModelConfig(device=args.device),
        optim=OptimConfig(lr=1e-6),
        loss=LossConfig(kl_coef=0.0),
        batch=BatchConfig(**batch_kw),  # type: ignore[arg-type]
    )
    dev = torch.device("cuda" if args.device == "cuda" else "cpu")
    backend = make_backend(backend_name, cfg, args)
    trajs = batch(args.samples, args.vocab)
    train_on(trajs[: max(args.samples // 8, 1)], backend, cfg)  # warm-up
    best = best_cpu = float("inf")
    tokens = 0
    for _ in range(args.repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        m = train_on(trajs, backend, cfg)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
        tokens = int(m["train_tokens"])
    from trainer.step import build_sequences, rank_microbatches

    samples, _, _ = build_sequences(trajs, cfg)
    padded = sum(mb.padded_tokens for mb in rank_microbatches(samples, backend, cfg))
    return tokens / best, best, padded, tokens / best_cpu


def teardown_process_groups() -> None:
    """Destroy the groups a training backend left up (Megatron's model-parallel groups over a
    one-rank default group): the push part joins a two-rank default group of its own."""
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        ps = None
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _raw_receiver(port: int, nbytes: int, timeout_s: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=1,
        world_size=2,
        timeout=timedelta(seconds=timeout_s),
    )
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(2):
        dist.broadcast(buf, src=0)
    dist.destroy_process_group()


def raw_broadcast_seconds(nbytes: int, timeout_s: float = 120.0) -> float:
    """Seconds of one gloo broadcast of `nbytes` to a receiver process (after a warm-up one).

    Every wait has a deadline (`timeout_s`: rendezvous, broadcasts, the receiver's exit), and
    the receiver is killed on any failure: a child left waiting in its rendezvous would be
    joined at interpreter exit, forever.
    """
    import multiprocessing as mp

    import torch.distributed as dist

    from searchr1.redis_server import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_raw_receiver, args=(port, nbytes, timeout_s), daemon=True)
    proc.start()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=2,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            buf = torch.ones(nbytes, dtype=torch.uint8)
            dist.broadcast(buf, src=0)  # warm-up
            t0 = time.perf_counter()
            dist.broadcast(buf, src=0)
            seconds = time.perf_counter() - t0
        finally:
            dist.destroy_process_group()
        proc.join(timeout_s)
        if proc.exitcode != 0:
            raise RuntimeError(
                f"raw-broadcast receiver did not finish cleanly within {timeout_s:.0f} s "
                f"(exit code {proc.exitcode})"
            )
        return seconds
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


async def push_seconds(args: argparse.Namespace, tmp: Path) -> tuple[float, int]:
    from harness.inference_server import InferenceServerProcess
    from inference.tiny_model import make_tiny_model
    from searchr1.redis_server import free_port
    from trainer.backends.hf import HFBackend, load_hf_model
    from trainer.config import LossConfig, ModelConfig, TrainerConfig, WeightPushConfig
    from trainer.dist import DistInfo
    from trainer.weights import WeightPusher

    model_dir = make_tiny_model(tmp / "model", hidden_size=args.hidden, num_layers=args.layers)
    cfg = TrainerConfig(model=ModelConfig(path=str(model_dir)), loss=LossConfig(kl_coef=0.0))
    backend = HFBackend(load_hf_model(cfg), cfg, DistInfo(0, 1, 0, torch.device("cpu")))
    with InferenceServerProcess(model_dir) as server:
        pusher = WeightPusher(
            WeightPushConfig(mode="distributed", engine_urls=[server.url], master_port=free_port())
        )
        try:
            await pusher.connect()
            await pusher.push(backend, step=1)  # warm-up
            res = await pusher.push(backend, step=2)
        finally:
            await pusher.close()
    assert res is not None
    return res.seconds, res.bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--padded-mbs", type=int, default=4, help="sequences per padded micro-batch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-push", action="store_true")
    ap.add_argument("--push-only", action="store_true")
    ap.add_argument(
        "--backends",
        default=None,
        help="comma-separated trainer.backend values (default: hf, and megatron when installed)",
    )
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    backends = (args.backends or default_backends()).split(",")

    kv: dict[str, object] = {"device": args.device, "hidden": args.hidden, "layers": args.layers}
    if not args.push_only:
        kv["samples"] = args.samples
        rates = {}
        for name in backends:
            rates[name] = train_bench(args, name)
            # hf's keys are unprefixed (as recorded before backends were a dimension)
            kv.update({(k if name == "hf" else f"{name}_{k}"): v for k, v in rates[name].items()})
        if {"hf", "megatron"} <= set(rates):
            ratio = rates["megatron"]["packed_tokens_per_s"] / rates["hf"]["packed_tokens_per_s"]
            cpu = (
                rates["megatron"]["packed_tokens_per_cpu_s"]
                / rates["hf"]["packed_tokens_per_cpu_s"]
            )
            print(f"megatron / hf, packed: {ratio:.2f}x by wall clock, {cpu:.2f}x per CPU-second")
            kv["megatron_over_hf_packed"] = round(ratio, 2)
            kv["megatron_over_hf_packed_cpu"] = round(cpu, 2)
        teardown_process_groups()
    if not args.no_push and args.device == "cpu":
        with tempfile.TemporaryDirectory() as tmp:
            push_s, nbytes = asyncio.run(push_seconds(args, Path(tmp)))
        raw_s = raw_broadcast_seconds(nbytes)
        print(f"weight push: {nbytes / 1e6:.1f} MB in {push_s:.3f} s; raw broadcast {raw_s:.3f} s")
        kv.update(
            push_s=round(push_s, 4),
            raw_broadcast_s=round(raw_s, 4),
            push_mb=round(nbytes / 1e6, 1),
            push_overhead=round(push_s / raw_s, 2),
        )
    print(" ".join(f"{k}={v}" for k, v in kv.items()))


def default_backends() -> str:
    import importlib.util

    try:
        megatron = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        megatron = False
    return "hf,megatron" if megatron else "hf"


def train_bench(args: argparse.Namespace, backend: str) -> dict[str, float]:
    budget = args.budget
    packed_rate, packed_s, packed_tok, packed_cpu = train_rate(
        args, backend, max_tokens_per_microbatch=budget
    )
    padded_rate, padded_s, padded_tok, padded_cpu = train_rate(
        args, backend, max_tokens_per_microbatch=budget, packing=False
    )
    # The usual padded trainer: a fixed number of sequences per micro-batch, padded to the
    # longest of them.
    fixed_rate, fixed_s, fixed_tok, fixed_cpu = train_rate(
        args,
        backend,
        max_tokens_per_microbatch=1 << 30,
        packing=False,
        max_samples_per_microbatch=args.padded_mbs,
    )
    print(f"backend {backend}:")
    print(
        f"packed:          {packed_rate:,.0f} tokens/s ({packed_s:.2f} s/step, {packed_tok} slots)"
    )
    print(
        f"tokens per CPU-second: packed {packed_cpu:,.0f}, padded (budget) {padded_cpu:,.0f}, "
        f"padded ({args.padded_mbs}/mb) {fixed_cpu:,.0f}"
    )
    print(
        f"padded (budget): {padded_rate:,.0f} tokens/s ({padded_s:.2f} s/step, {padded_tok} slots)"
    )
    print(
        f"padded ({args.padded_mbs}/mb):   {fixed_rate:,.0f} tokens/s "
        f"({fixed_s:.2f} s/step, {fixed_tok} slots)"
    )
    return {
        "packed_tokens_per_s": round(packed_rate),
        "padded_budget_tokens_per_s": round(padded_rate),
        "padded_fixed_tokens_per_s": round(fixed_rate),
        "speedup_vs_padded_budget": round(packed_rate / padded_rate, 2),
        "speedup_vs_padded_fixed": round(packed_rate / fixed_rate, 2),
        "cpu_speedup_vs_padded_budget": round(packed_cpu / padded_cpu, 2),
        "cpu_speedup_vs_padded_fixed": round(packed_cpu / fixed_cpu, 2),
        "packed_tokens_per_cpu_s": round(packed_cpu),
        "slot_ratio_budget": round(padded_tok / packed_tok, 2),
        "slot_ratio_fixed": round(fixed_tok / packed_tok, 2),
    }


if __name__ == "__main__":
    main()
