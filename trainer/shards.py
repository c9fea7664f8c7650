"""Sharded checkpoint files: every rank writes its own blocks; any rank reads any rectangle back.

A block is a rectangle of the 2-D view of a global tensor (a tensor of shape `(a, b, c)` is
viewed as `(a, b * c)`, a vector of `n` as `(n, 1)`). Each rank writes one safetensors file,
`rank_00003.safetensors`, with its blocks; where each block sits (key, row, column) and the
global shapes of its keys are JSON in the file's safetensors header, and `index.json` (written
by the main rank once every file is complete) names the files. A reader takes the rectangles
it needs from whichever files hold them, so the layout that wrote a checkpoint (which rank
held what) and the one that reads it may differ.

Nothing here is unpickled: the index and the headers are JSON, the tensors raw bytes
(`safetensors`). Checkpoints live on a shared volume, and write access to it must not be code
execution in the trainer.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT = "searchr1-shards/1"
INDEX = "index.json"
_FILE = re.compile(r"^rank_\d{5}\.safetensors$")


@dataclass(frozen=True)
class Block:
    key: str
    row: int
    col: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def fsync(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rank(
    directory: Path,
    rank: int,
    blocks: list[tuple[Block, torch.Tensor]],
    shapes: dict[str, tuple[int, int]],
) -> Path:
    """This rank's file: `blocks` (each tensor `rows x cols`) and the 2-D global shape of
    each key it holds; fsynced."""
    from safetensors.torch import save_file

    tensors, placed = {}, []
    for i, (b, t) in enumerate(blocks):
        if tuple(t.shape) != (b.rows, b.cols):
            raise ValueError(f"{b}: tensor of shape {tuple(t.shape)}")
        tensors[str(i)] = t.detach().contiguous().cpu()
        placed.append([str(i), b.key, b.row, b.col, b.rows, b.cols])
    meta = {"format": FORMAT, "blocks": json.dumps(placed), "shapes": json.dumps(shapes)}
    path = directory / rank_file(rank)
    save_file(tensors, str(path), metadata=meta)
    fsync(path)
    return path


def write_index(directory: Path, world_size: int, extra: dict[str, Any] | None = None) -> None:
    """The main rank, after every rank's file is written; fsynced with the directory."""
    index = {"format": FORMAT, "files": [rank_file(r) for r in range(world_size)]}
    path = directory / INDEX
    path.write_text(json.dumps({**index, **(extra or {})}))
    fsync(path)
    fsync(directory)


class ShardReader:
    """Reads rectangles of global tensors from a directory of rank files (a context manager:
    the files stay open, memory-mapped, while it is)."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.directory = directory
        index = json.loads((directory / INDEX).read_text())
        if index.get("format") != FORMAT:
            raise ValueError(f"{directory}: not a {FORMAT} checkpoint ({index.get('format')})")
        self._stack = ExitStack()
        self._saved: dict[str, list[tuple[Any, str, Block]]] = {}
        self.shapes: dict[str, tuple[int, int]] = {}
        for name in index["files"]:
            if not isinstance(name, str) or not _FILE.match(name):
                raise ValueError(f"{directory}: bad file name in {INDEX}: {name!r}")
            f = self._stack.enter_context(safe_open(str(directory / name), "pt"))
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{directory / name}: not a {FORMAT} file")
            for key, shape in json.loads(meta["shapes"]).items():
                shape = (int(shape[0]), int(shape[1]))
                if self.shapes.setdefault(key, shape) != shape:
                    raise ValueError(f"{directory}: {key}: shapes {shape}, {self.shapes[key]}")
            for tensor, key, row, col, rows, cols in json.loads(meta["blocks"]):
                block = Block(str(key), int(row), int(col), int(rows), int(cols))
                self._saved.setdefault(block.key, []).append((f, str(tensor), block))

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def read(self, block: Block, out: torch.Tensor) -> None:
        """Fill `out` (`block.rows x block.cols`) from the saved blocks that overlap it; a
        ValueError unless they cover it exactly once."""
        covered = 0
        for f, tensor, saved in self._saved.get(block.key, []):
            r0, r1 = max(block.row, saved.row), min(block.row + block.rows, saved.row + saved.rows)
            c0, c1 = max(block.col, saved.col), min(block.col + block.cols, saved.col + saved.cols)
            if r1 <= r0 or c1 <= c0:
                continue
            part = f.get_slice(tensor)[
                r0 - saved.row : r1 - saved.row, c0 - saved.col : c1 - saved.col
            ]
            out[r0 - block.row : r1 - block.row, c0 - block.col : c1 - block.col] = part
            covered += (r1 - r0) * (c1 - c0)
        if covered != block.numel:
            raise ValueError(
                f"{self.directory}: {block} is covered by {covered} saved elements, "
                f"not {block.numel} (a missing or inconsistent rank file)"
            )
