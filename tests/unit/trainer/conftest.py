"""Fixtures for trainer tests: a tiny random Qwen2 (no tokenizer needed for the math)."""

from __future__ import annotations

import random

import pytest
import torch

from protos.trajectory import Trajectory
from tests import factories

VOCAB = 128


def tiny_qwen2(seed: int = 0, **overrides: object):  # type: ignore[no-untyped-def]
    """`overrides` go to `Qwen2Config` (e.g. attention_dropout, use_sliding_window)."""
    from transformers import Qwen2ForCausalLM

    from inference.tiny_model import qwen2_config

    torch.manual_seed(seed)
    cfg = qwen2_config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=512,
        intermediate_size=128,
        **overrides,
    )
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg)


def make_trajectory(
    tid: str,
    group: str,
    reward: float,
    *,
    prompt_len: int,
    response_len: int,
    seed: int,
    observation: tuple[int, int] | None = None,
    rollout_logprobs: list[float] | None = None,
) -> Trajectory:
    """The shared builder with the trainer tests' defaults: ids within the tiny vocabulary,
    no observation span, no rollout logprobs, temperature 1 (an unset field)."""
    return factories.make_trajectory(
        tid,
        group_id=group,
        reward=reward,
        prompt_len=prompt_len,
        response_len=response_len,
        seed=seed,
        vocab=VOCAB,
        observation=observation,
        rollout_logprobs=rollout_logprobs,
        temperature=0.0,
    )


def make_batch(n_groups: int = 2, group_size: int = 4, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        for k in range(group_size):
            out.append(
                make_trajectory(
                    f"g{g}-s{k}",
                    f"g{g}",
                    float(k % 2),
                    prompt_len=rng.randint(3, 10),
                    response_len=rng.randint(4, 20),
                    seed=rng.randrange(1 << 30),
                    observation=(1, 3),
                )
            )
    return out


@pytest.fixture
def tiny_model():  # type: ignore[no-untyped-def]
    return tiny_qwen2()
