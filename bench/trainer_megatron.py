"""Megatron backend vs HF backend: training tokens/s of one GRPO step on the same batches.

    python bench/trainer_megatron.py [--samples 16] [--budget 1024] [--hidden 128]
                                     [--layers 2] [--repeats 2]

One process on CPU, fp32 (TP = PP = DP = 1): the old-logprob forward, the packed
forward/backward and the optimizer step of `trainer.step.train_on`, on the same random Qwen2
and the same trajectories for both backends; the first step of each backend is a warm-up.
Multi-rank layouts are for correctness here (`tests/unit/trainer/megatron`): on a 2-core
machine extra ranks only share the same cores. The last line is key=value pairs. (Not named
`bench/megatron.py`: the script's folder comes first on sys.path and would shadow megatron.)
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from protos.trajectory import SCHEMA_VERSION, Trajectory


def batch(n: int, vocab: int, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, response = rng.randint(40, 120), rng.randint(20, 300)
        t = Trajectory(
            schema_version=SCHEMA_VERSION,
            trajectory_id=f"t{i}",
            group_id=f"g{i // 4}",
            prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt)],
            response_token_ids=[rng.randrange(vocab) for _ in range(response)],
            loss_mask=bytes([1] * response),
            rollout_logprobs=[0.0] * response,
        )
        t.reward.total = float(i % 2)
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
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=2048,
    )
    return Qwen2ForCausalLM(cfg)


def tokens_per_s(backend, cfg, batches) -> float:  # type: ignore[no-untyped-def]
    from trainer.step import train_on

    train_on(batches[0], backend, cfg)  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for b in batches[1:]:
        tokens += sum(len(t.prompt_token_ids) + len(t.response_token_ids) for t in b)
        train_on(b, backend, cfg)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)

    from trainer.config import TrainerConfig
    from trainer.dist import DistInfo
    from trainer.hf_backend import HFBackend
    from trainer.megatron.backend import MegatronBackend

    cfg = TrainerConfig(
        loss={"kl_coef": 0.001},
        batch={"max_tokens_per_microbatch": a.budget},
        model={"attn_implementation": "varlen"},
    )
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    batches = [batch(a.samples, a.vocab, seed) for seed in range(a.repeats + 1)]
    hf = model(a.hidden, a.layers, a.vocab)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    hf_tps = tokens_per_s(HFBackend(hf, cfg, info), cfg, batches)
    print(f"hf backend: {hf_tps:.0f} tokens/s", flush=True)
    meg = MegatronBackend(state, hf.config, cfg.model_copy(update={"backend": "megatron"}), info)
    meg_tps = tokens_per_s(meg, cfg, batches)
    print(f"megatron backend: {meg_tps:.0f} tokens/s", flush=True)
    print(
        f"hf_tokens_per_s={hf_tps:.0f} megatron_tokens_per_s={meg_tps:.0f} "
        f"megatron_over_hf={meg_tps / hf_tps:.2f} samples={a.samples} hidden={a.hidden} "
        f"layers={a.layers}"
    )


if __name__ == "__main__":
    main()
