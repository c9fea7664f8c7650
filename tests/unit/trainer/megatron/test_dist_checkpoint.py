"""Distributed checkpoints of the Megatron backend (`trainer/backends/megatron/sharded.py`).

In-process: every rank's blocks (a DP range of its TP shard, mapped to the full tensor) hold
exactly the elements `convert.shard` gives that rank, and all ranks together cover each full
tensor (vocabulary padding cut) exactly once. Under torchrun (`dist_ckpt_worker.py`): every
rank writes its own file, nothing is gathered; a resume at the same layout is bit-identical;
a TP=2 checkpoint resumes at PP=2, at DP=2 (the distributed optimizer's ranges) and at TP=1
with the same weights and Adam moments and the same next-step loss (1e-6).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.small_disk import small_tmpfs
from tests.support.torchrun import torchrun, torchrun_env
from trainer.backends.megatron import convert
from trainer.backends.megatron.model import ModelShape, padded_vocab
from trainer.backends.megatron.parallel import Layout
from trainer.backends.megatron.sharded import blocks, placement

pytest.importorskip("megatron.core")

WORKER = Path(__file__).with_name("dist_ckpt_worker.py")
SHAPE = ModelShape(
    vocab_size=100,
    hidden_size=8,
    intermediate_size=12,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    rms_eps=1e-6,
    qkv_bias=True,
    tied=False,
    max_positions=64,
    attention_dropout=0.0,
    inv_freq=(1.0,),
)


def _full_shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    s, qkv = SHAPE, (SHAPE.num_heads + 2 * SHAPE.num_kv_heads) * SHAPE.head_dim
    return {
        "embedding.word_embeddings.weight": (vocab, s.hidden_size),
        "decoder.layers.1.self_attention.linear_qkv.weight": (qkv, s.hidden_size),
        "decoder.layers.1.self_attention.linear_qkv.bias": (qkv,),
        "decoder.layers.1.self_attention.linear_proj.weight": (s.hidden_size, 8),
        "decoder.layers.1.mlp.linear_fc1.weight": (2 * s.intermediate_size, s.hidden_size),
        "decoder.layers.1.mlp.linear_fc2.weight": (s.hidden_size, s.intermediate_size),
        "decoder.layers.1.input_layernorm.weight": (s.hidden_size,),
        "output_layer.weight": (vocab, s.hidden_size),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_blocks_hold_each_ranks_shard_and_cover_the_full_tensor_once(tp: int) -> None:
    vocab = padded_vocab(SHAPE.vocab_size, tp, 16)  # 112 at TP=2: rows 100.. are padding
    for name, full_shape in _full_shapes(vocab).items():
        full = torch.randn(full_shape)
        seen: torch.Tensor | None = None
        for r in range(tp):
            local = convert.shard(name, full, r, tp)
            layout = Layout(tp=tp, pp=1, dp=3, tp_rank=r, pp_rank=0, dp_rank=0)
            p = placement(name, tuple(local.shape), SHAPE, layout)
            view = full.reshape(full.shape[0], -1)[: p.shape[0]]
            seen = torch.zeros(p.shape, dtype=torch.int) if seen is None else seen
            n = local.numel()
            # Three DP ranges of uneven sizes, as the distributed optimizer cuts them.
            for start, end in [(0, n // 3 + 1), (n // 3 + 1, n - 5), (n - 5, n)]:
                part = local.reshape(-1)[start:end]
                for b, off in blocks(p, start, end):
                    want = view[b.row : b.row + b.rows, b.col : b.col + b.cols]
                    assert torch.equal(part[off : off + b.numel].view(b.rows, b.cols), want)
                    if not p.replicated or r == 0:
                        seen[b.row : b.row + b.rows, b.col : b.col + b.cols] += 1
        assert seen is not None and torch.equal(seen, torch.ones_like(seen)), name


def test_the_tied_embedding_on_the_last_stage_maps_to_the_embedding() -> None:
    from dataclasses import replace

    layout = Layout(tp=2, pp=2, dp=1, tp_rank=1, pp_rank=1, dp_rank=0)
    p = placement("output_layer.weight", (56, 8), replace(SHAPE, tied=True), layout)
    assert p.key == "embedding.word_embeddings.weight" and p.segments == ((0, 44, 56),)
    layer = placement("decoder.layers.0.mlp.linear_fc1.weight", (12, 8), SHAPE, layout)
    assert layer.key == "decoder.layers.1.mlp.linear_fc1.weight"  # the stage's layer offset
    assert layer.segments == ((0, 6, 6), (6, 12, 18))  # the gate half, the up half


def _torchrun(tmp: Path, ranks: int, mode: str, tp: int, pp: int) -> None:
    ckpt, ref = tmp / "ckpt", tmp / "ref"
    ref.mkdir(exist_ok=True)
    cmd = torchrun(ranks, str(WORKER), mode, str(tp), str(pp), str(ckpt), str(ref))
    proc = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _blocks_of(path: Path) -> dict[str, list[list]]:  # type: ignore[type-arg]
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        out: dict[str, list[list]] = {}  # type: ignore[type-arg]
        for _name, key, *rect in json.loads(f.metadata()["blocks"]):
            out.setdefault(key, []).append(rect)
        return out


@pytest.mark.slow  # over 10 s: CI's slow phase (issue 45)
def test_one_rank_saves_shards_and_resumes_bit_identically(tmp_path: Path) -> None:
    _torchrun(tmp_path, 1, "save", 1, 1)
    step = tmp_path / "ckpt" / "step_00000001"
    assert sorted(p.name for p in (step / "shards").iterdir()) == [
        "index.json",
        "rank_00000.safetensors",
    ]
    assert set(torch.load(step / "state.pt", weights_only=True)) == {
        "optimizer_steps",
        "train_steps",
        "rng",
    }


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("tp2")
    _torchrun(tmp, 2, "save", 2, 1)
    return tmp


@pytest.mark.slow
def test_tp2_ranks_write_their_own_shards(tp2_checkpoint: Path) -> None:
    shards = tp2_checkpoint / "ckpt" / "step_00000001" / "shards"
    key = "exp_avg/decoder.layers.0.self_attention.linear_qkv.weight"
    rows = [[r[0] for r in _blocks_of(shards / f"rank_0000{k}.safetensors")[key]] for k in (0, 1)]
    # Rank 0 holds the first half of the QKV rows (its TP shard), rank 1 the second half.
    assert min(rows[0]) == 0 and min(rows[1]) == 64, rows
    sizes = [(shards / f"rank_0000{k}.safetensors").stat().st_size for k in (0, 1)]
    assert max(sizes) < 0.75 * sum(sizes), sizes  # no rank holds (nearly) everything


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "tp", "pp"), [(2, 1, 2), (2, 1, 1), (1, 1, 1)], ids=["pp2", "dp2", "tp1"]
)
def test_a_tp2_checkpoint_resumes_at_another_layout(
    tp2_checkpoint: Path, ranks: int, tp: int, pp: int
) -> None:
    _torchrun(tp2_checkpoint, ranks, "resume", tp, pp)
    diffs = json.loads((tp2_checkpoint / "ref" / f"resume-tp{tp}-pp{pp}.json").read_text())
    assert diffs["state"] == 0.0, diffs  # weights and Adam's moments: copies only
    assert diffs["optimizer_steps"] == 2, diffs
    assert diffs["loss"] <= 1e-6 and diffs["after"] <= 1e-5, diffs


@pytest.mark.slow
def test_a_shard_that_meets_a_full_disk_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's shard meets ENOSPC (a real one: a 16 MiB tmpfs, filled by rank 1 after rank
    0 wrote its shard): both ranks raise `CheckpointDiskFull` (rank 0 used to wait at the
    barrier after the shard writes, where rank 1's next collective met it), nothing partial is
    left, and with room again the next save works."""
    with small_tmpfs(tmp_path / "disk", 16 * 2**20) as disk:
        (tmp_path / "ref").mkdir()
        cmd = torchrun(2, str(WORKER), "full", "2", "1", str(disk / "ckpt"), str(tmp_path / "ref"))
        # Short: without the fix the ranks' collectives no longer pair up and hang.
        run = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    result = json.loads((tmp_path / "ref" / "full.json").read_text())
    assert "disk full" in result["raised"], result
    assert result["left"] == [], result
    assert result["after"] == ["latest", "step_00000001"], result
