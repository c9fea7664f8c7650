"""Run under torchrun by `test_dist_checkpoint.py`: distributed checkpoints of the Megatron
backend through the trainer's `CheckpointManager`.

    torchrun --nproc-per-node N dist_ckpt_worker.py save TP PP CKPT_DIR REF_DIR
    torchrun --nproc-per-node N dist_ckpt_worker.py resume TP PP CKPT_DIR REF_DIR
    torchrun --nproc-per-node 2 dist_ckpt_worker.py full TP PP CKPT_DIR REF_DIR

`full` (CKPT_DIR on a small filesystem of its own): one GRPO step, then a checkpoint whose
rank-1 shard meets a real ENOSPC (rank 1 fills the disk once rank 0's shard is written):
every rank raises `CheckpointDiskFull` (none waits at a barrier), nothing partial is left,
and once there is room the next save works on every rank; rank 0 writes `full.json`.
`save`: one GRPO step, a checkpoint (gathering the full state is forbidden meanwhile: every
rank writes its own shards), then a fresh backend at the same layout loads it: the same state
(weights and Adam's moments, gathered in HF names), the same trainer state, and the next step
bit-identical to the uninterrupted backend's. Rank 0 keeps the reference (the state at the
checkpoint, the next step's loss and weights) in REF_DIR. `resume`: a backend at another
layout loads the checkpoint; rank 0 writes the differences from the reference as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from harness.small_disk import fill
from searchr1.bus import Receipt
from tests.unit.trainer.conftest import make_batch, tiny_qwen2
from trainer.backends.megatron import sharded
from trainer.checkpoint import CheckpointDiskFull, CheckpointManager, TrainerState
from trainer.config import TrainerConfig
from trainer.dist import DistInfo, close_distributed
from trainer.shards import rank_file
from trainer.step import train_on

RECEIPTS = [Receipt("1-0", "g0-s0"), Receipt("1-1", "g0-s1")]


def flat(state: dict) -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
    """`full_state()` as one flat dict of tensors (HF names)."""
    out = {f"model/{k}": v for k, v in state["model"].items()}
    for kind in ("exp_avg", "exp_avg_sq"):
        out.update({f"{kind}/{k}": v for k, v in state["optimizer"][kind].items()})
    return {k: v.contiguous() for k, v in out.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main() -> None:
    from safetensors.torch import load_file, save_file

    from trainer.backends.megatron.backend import MegatronBackend

    mode, tp, pp, ckpt, ref = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ref_dir = Path(ref)
    cfg = TrainerConfig(
        backend="megatron",
        megatron={"tp": tp, "pp": pp},
        optim={"lr": 1e-3, "grad_clip": 1.0},
        loss={"kl_coef": 0.0},
        checkpoint={"dir": ckpt},
    )

    def build() -> MegatronBackend:
        hf = tiny_qwen2()
        info = DistInfo(rank, world, rank, torch.device("cpu"))
        return MegatronBackend(dict(hf.state_dict()), hf.config, cfg, info)

    mgr = CheckpointManager(cfg.checkpoint)
    nxt = make_batch(2, 4, seed=2)
    if mode == "full":
        disk_full_on_rank_1(build(), mgr, cfg, rank, ref_dir)
        return
    if mode == "save":
        meg = build()
        train_on(make_batch(2, 4, seed=1), meg, cfg)

        def no_gather() -> dict:  # type: ignore[type-arg]
            raise AssertionError("a distributed checkpoint gathered the full state")

        meg.full_state = no_gather  # type: ignore[method-assign]
        mgr.save(meg, TrainerState(step=1, receipts=RECEIPTS, weight_version=1))
        del meg.full_state
        saved = meg.full_state()
        # An export's load: the weights, and not one read of Adam's moments.
        kinds: list[str] = []
        read = sharded._read
        sharded._read = lambda reader, kind, *a: kinds.append(kind) or read(reader, kind, *a)
        weights = build()
        mgr.load(weights, weights_only=True)
        sharded._read = read
        exported, trained = dict(weights.named_tensors()), dict(meg.named_tensors())
        if rank == 0:
            assert set(kinds) == {"param"}, set(kinds)
            assert max_diff(exported, trained) == 0.0
        again = build()
        state = mgr.load(again)
        loaded = again.full_state()
        if rank == 0:
            assert state is not None and state.receipts == RECEIPTS, state
            assert state.step == 1 and state.weight_version == 1, state
            assert max_diff(flat(saved), flat(loaded)) == 0.0
            save_file(flat(saved), str(ref_dir / "state.safetensors"))
        assert again.optimizer_steps == meg.optimizer_steps == 1
        m1, m2 = train_on(nxt, meg, cfg), train_on(nxt, again, cfg)
        w1, w2 = dict(meg.named_tensors()), dict(again.named_tensors())
        if rank == 0:
            assert m1["loss"] == m2["loss"] and max_diff(w1, w2) == 0.0, (m1, m2)
            save_file(w1, str(ref_dir / "after.safetensors"))
            (ref_dir / "next.json").write_text(json.dumps({"loss": m1["loss"]}))
        return
    meg = build()
    state = mgr.load(meg)
    loaded = meg.full_state()
    metrics = train_on(nxt, meg, cfg)
    after = dict(meg.named_tensors())
    if rank == 0:
        assert state is not None and state.receipts == RECEIPTS and state.step == 1, state
        want = json.loads((ref_dir / "next.json").read_text())
        diffs = {
            "state": max_diff(flat(loaded), load_file(str(ref_dir / "state.safetensors"))),
            "loss": abs(metrics["loss"] - want["loss"]),
            "after": max_diff(after, load_file(str(ref_dir / "after.safetensors"))),
            "optimizer_steps": meg.optimizer_steps,
        }
        (ref_dir / f"resume-tp{tp}-pp{pp}.json").write_text(json.dumps(diffs))


def disk_full_on_rank_1(
    meg: object, mgr: CheckpointManager, cfg: TrainerConfig, rank: int, ref_dir: Path
) -> None:
    """CKPT_DIR is on a small filesystem of its own: rank 1 fills it once rank 0's shard is
    written, so only rank 1's write meets ENOSPC."""
    train_on(make_batch(2, 4, seed=1), meg, cfg)  # type: ignore[arg-type]
    write = sharded.write_rank

    def fill_then_write(directory: Path, r: int, *a: object) -> Path:
        deadline = time.monotonic() + 120
        while not (directory / rank_file(0)).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        fill(mgr.root.parent)
        return write(directory, r, *a)  # type: ignore[arg-type]

    if rank == 1:
        sharded.write_rank = fill_then_write  # type: ignore[assignment]
    try:
        mgr.save(meg, TrainerState(step=1))  # type: ignore[arg-type]
    except CheckpointDiskFull as e:
        raised = str(e)
    else:
        raised = ""
    sharded.write_rank = write
    if not raised:
        raise SystemExit(f"rank {rank}: the save did not raise CheckpointDiskFull")
    left = sorted(p.name for p in mgr.root.iterdir())
    if rank == 1:
        (mgr.root.parent / "filler").unlink()
    # Room again: the next save works on every rank (the ranks' collectives still pair up).
    saved = mgr.save(meg, TrainerState(step=1))  # type: ignore[arg-type]
    if rank == 0:
        assert saved is not None and mgr.latest() == saved, saved
        out = {"raised": raised, "left": left, "after": sorted(p.name for p in mgr.root.iterdir())}
        (ref_dir / "full.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
    close_distributed()
