"""Sharded checkpoint files (`trainer.shards`): blocks written by several ranks read back at
any other rectangle; gaps and overlaps refused; nothing in a checkpoint is unpickled."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.trainer.test_checkpoint import Intruder
from trainer.backend import TrainerBackend
from trainer.checkpoint import SHARDS, CheckpointManager, TrainerState
from trainer.config import CheckpointConfig
from trainer.shards import Block, ShardReader, write_index, write_rank

FULL = torch.arange(42.0).view(6, 7)


def _blk(row: int, col: int, rows: int, cols: int) -> tuple[Block, torch.Tensor]:
    return Block("w", row, col, rows, cols), FULL[row : row + rows, col : col + cols]


def _write(directory: Path, ranks: list[list[tuple[Block, torch.Tensor]]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, blocks in enumerate(ranks):
        write_rank(directory, rank, blocks, {"w": (6, 7)})
    write_index(directory, len(ranks))


# Uneven blocks, as a DP range of a flattened shard gives: partial rows, whole rows.
LAYOUT = [[_blk(0, 0, 1, 7), _blk(1, 0, 1, 3)], [_blk(1, 3, 1, 4), _blk(2, 0, 4, 7)]]


def test_any_rectangle_reads_back_across_rank_files(tmp_path: Path) -> None:
    _write(tmp_path, LAYOUT)
    with ShardReader(tmp_path) as reader:
        assert reader.shapes == {"w": (6, 7)}
        for row, col, rows, cols in [(0, 0, 6, 7), (1, 2, 3, 4), (5, 6, 1, 1), (0, 3, 2, 4)]:
            out = torch.full((rows, cols), -1.0)
            reader.read(Block("w", row, col, rows, cols), out)
            assert torch.equal(out, FULL[row : row + rows, col : col + cols])


def test_a_gap_or_an_overlap_is_refused(tmp_path: Path) -> None:
    _write(tmp_path / "gap", [[_blk(0, 0, 1, 7)], [_blk(2, 0, 4, 7)]])
    with ShardReader(tmp_path / "gap") as reader, pytest.raises(ValueError, match="covered"):
        reader.read(Block("w", 0, 0, 6, 7), torch.zeros(6, 7))
    _write(tmp_path / "twice", [[_blk(0, 0, 6, 7)], [_blk(1, 0, 1, 7)]])
    with ShardReader(tmp_path / "twice") as reader, pytest.raises(ValueError, match="covered"):
        reader.read(Block("w", 0, 0, 6, 7), torch.zeros(6, 7))


def test_an_index_naming_another_file_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, LAYOUT)
    (tmp_path / "index.json").write_text(
        '{"format": "searchr1-shards/1", "files": ["../../etc/passwd"]}'
    )
    with pytest.raises(ValueError, match="bad file name"):
        ShardReader(tmp_path)


class ShardedBackend(TrainerBackend):
    """Only what `CheckpointManager` calls on a backend with sharded checkpoints."""

    sharded_checkpoints = True

    def __init__(self) -> None:
        self.loaded: list[Any] = []

    def save_shards(self, directory: Path) -> dict[str, Any]:
        _write(directory, LAYOUT)
        return {"optimizer_steps": 3}

    def load_shards(
        self, directory: Path | None, state: dict[str, Any] | None, *, weights_only: bool = False
    ) -> None:
        assert directory is not None
        with ShardReader(directory) as reader:
            out = torch.zeros(6, 7)
            reader.read(Block("w", 0, 0, 6, 7), out)
        self.loaded.append((out, state))

    def __getattr__(self, name: str) -> Any:  # the abstract methods: never called here
        raise AssertionError(name)


ShardedBackend.__abstractmethods__ = frozenset()


def test_a_sharded_checkpoint_round_trips_through_the_manager(tmp_path: Path) -> None:
    mgr = CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    path = mgr.save(ShardedBackend(), TrainerState(step=4, weight_version=4))
    assert path is not None and (path / SHARDS / "rank_00001.safetensors").exists()
    # state.pt keeps only the small rest, plain data (no weights).
    small = torch.load(path / "state.pt", weights_only=True)
    assert set(small) == {"optimizer_steps", "rng"}
    backend = ShardedBackend()
    state = mgr.load(backend)
    assert state is not None and state.step == 4 and state.weight_version == 4
    ((out, rest),) = backend.loaded
    assert torch.equal(out, FULL) and rest == {"optimizer_steps": 3}


def test_pickle_payloads_in_a_sharded_checkpoint_never_run(tmp_path: Path) -> None:
    """Write access to the checkpoint volume must not be code execution in the trainer:
    the pickled files of torch.distributed.checkpoint / Megatron's dist_checkpointing
    (`.metadata`, `common.pt`) planted in the shards are never read, and a payload in
    `state.pt` (read with torch's weights_only unpickler) is refused before any shard is."""
    mgr = CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    path = mgr.save(ShardedBackend(), TrainerState(step=1))
    assert path is not None
    marker = tmp_path / "owned"
    for name in (".metadata", "common.pt"):
        (path / SHARDS / name).write_bytes(pickle.dumps(Intruder(marker)))
    backend = ShardedBackend()
    mgr.load(backend)
    assert backend.loaded and not marker.exists()

    state = torch.load(path / "state.pt", weights_only=True)
    state["payload"] = Intruder(marker)
    torch.save(state, path / "state.pt")
    backend = ShardedBackend()
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        mgr.load(backend)
    assert not backend.loaded and not marker.exists()
