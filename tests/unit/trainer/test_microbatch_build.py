"""Micro-batches are built with tensor ops per sequence and once per step (bench/pipeline.py
found the per-token build, three times a step, on the trainer's critical path)."""

from __future__ import annotations

import random

import pytest
import torch

from harness.sim.trainer import SleepingBackend, TrainerCost
from tests.factories import make_trajectory
from trainer import batching, step
from trainer.batching import MicroBatch, TrainSequence, build_microbatch
from trainer.config import TrainerConfig


def per_token_reference(seqs: list[TrainSequence], packed: bool) -> dict[str, list[int | float]]:
    """The fields a micro-batch derives per token, spelled out one token at a time."""
    out: dict[str, list[int | float]] = {k: [] for k in ("row", "pos", "tgt", "k", "temp")}
    offset = 0
    for k, s in enumerate(seqs):
        start, row = (offset, 0) if packed else (0, k)
        for j in range(s.prompt_len, s.length):
            out["row"].append(row)
            out["pos"].append(start + max(j - 1, 0))
            out["tgt"].append(s.input_ids[j])
            out["k"].append(k)
            out["temp"].append(s.temperature)
        offset += s.length
    return out


@pytest.mark.parametrize("packed", [True, False])
def test_a_micro_batch_matches_its_per_token_definition(packed: bool) -> None:
    rng = random.Random(0)
    for _ in range(100):
        seqs = []
        for i in range(rng.randrange(1, 7)):
            p, r = rng.randrange(0, 20), rng.randrange(0, 30)
            ids = [rng.randrange(1000) for _ in range(p + r)] or [1]
            temp = rng.choice([1.0, 0.7])
            seqs.append(TrainSequence(str(i), "g", ids, min(p, len(ids)), torch.ones(r), None,
                                      0.0, temperature=temp))  # fmt: skip
        mb = build_microbatch(seqs, list(range(len(seqs))), packed=packed)
        ref = per_token_reference(seqs, packed)
        positions = mb.keep_positions[mb.row_keep].tolist()
        assert mb.row_batch.tolist() == ref["row"] and positions == ref["pos"]
        assert mb.targets.tolist() == ref["tgt"] and mb.sample_index.tolist() == ref["k"]
        assert mb.temperatures.tolist() == pytest.approx(ref["temp"])
        flat = [t for s in seqs for t in s.input_ids]
        if packed:
            assert mb.input_ids.tolist() == [flat]
            assert mb.position_ids.tolist() == [[p for s in seqs for p in range(s.length)]]
            assert mb.cu_seqlens is not None
            assert mb.cu_seqlens.tolist()[-1] == len(flat) and mb.cu_seqlens.dtype == torch.int32
        else:
            assert mb.attention_mask is not None
            assert mb.attention_mask.sum().item() == len(flat)
        assert mb.num_tokens == len(flat)


def test_a_step_builds_its_micro_batches_once(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[MicroBatch] = []
    real = batching.build_microbatch

    def counting(*args: object, **kwargs: object) -> MicroBatch:
        built.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return built[-1]

    monkeypatch.setattr(step, "build_microbatch", counting)
    cfg = TrainerConfig(batch={"max_tokens_per_microbatch": 64})  # several micro-batches
    trajs = [make_trajectory(f"t-{i}", group_id=f"g-{i // 4}", reward=float(i % 2), seed=i)
             for i in range(8)]  # fmt: skip
    backend = SleepingBackend(cfg, TrainerCost(time_scale=1e9))
    metrics = step.train_on(trajs, backend, cfg)  # old and reference logprobs, then training
    n = len(built)
    assert n >= 2 and metrics["train_tokens"] == sum(mb.num_tokens for mb in built)

    built.clear()
    cfg.batch.num_minibatches = 2  # mini-batches are parts of the batch: built per part
    step.train_on(trajs, backend, cfg)
    assert len(built) > n
