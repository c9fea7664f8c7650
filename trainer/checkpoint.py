"""Atomic checkpoints: model, optimizer, scheduler, RNG, step and the bus receipts of the step.

Layout: `<dir>/step_00000012/{state.pt,trainer.json}` plus `<dir>/latest` naming the newest
complete one. A checkpoint is written into a temporary directory, fsynced, renamed into place,
and only then does `latest` move (write + rename), so a crash at any point leaves the previous
checkpoint intact and never a half-written one under a final name.

A backend with sharded checkpoints (`sharded_checkpoints`, the Megatron backend) adds
`shards/`: every rank writes its own file there (`trainer.shards`, safetensors + JSON), and
`state.pt` keeps only the small rest (counters, RNG). The checkpoint directory must then be
on a volume every rank sees; the temporary directory's name is the same on every rank.

The receipts stored are those of every trajectory trained since the previous checkpoint: the
loop acknowledges them on the bus only after this checkpoint is durable, and re-acknowledges
them on resume (the crash may have hit between the two).

A save that finds no room raises `CheckpointDiskFull` after removing what it had written: the
last good checkpoint stays `latest`, and the loop trains on and tries again at the next one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from searchr1.bus import Receipt
from trainer.backend import TrainerBackend
from trainer.config import CheckpointConfig
from trainer.shards import fsync

log = logging.getLogger(__name__)

LATEST = "latest"
PREFIX = "step_"
SHARDS = "shards"
# A failed write with less room than this left is a full disk: torch.save reports ENOSPC only
# as "unexpected pos", and a failure on another rank arrives as that rank's message.
NEARLY_FULL_BYTES = 2**20


class CheckpointDiskFull(OSError):
    """A checkpoint could not be written for want of room under `trainer.checkpoint.dir`."""


def _is_disk_full(error: BaseException, root: Path) -> bool:
    e: BaseException | None = error
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "os error 28" in str(e):
            return True
        e = e.__cause__ or e.__context__
    try:
        return shutil.disk_usage(root).free < NEARLY_FULL_BYTES
    except OSError:
        return False


@dataclass
class TrainerState:
    step: int = 0
    receipts: list[Receipt] = field(default_factory=list)
    weight_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "receipts": [list(r) for r in self.receipts],
            "weight_version": self.weight_version,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerState:
        return cls(
            step=int(data["step"]),
            receipts=[Receipt(*r) for r in data.get("receipts", [])],
            weight_version=int(data.get("weight_version", 0)),
            extra=dict(data.get("extra", {})),
        )


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _load_state(file: Path) -> dict[str, Any]:
    # weights_only: tensors and plain data (dicts, lists, tuples, numbers, strings) and nothing
    # else, so write access to the checkpoint volume is not code execution in the trainer.
    # Everything `save` writes is of that kind (model/optimizer/scheduler state dicts, the
    # step count, torch's and Python's RNG states).
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"{file}: refused: it holds objects other than tensors and plain data "
            f"(loaded with weights_only=True): {str(e).splitlines()[0]}"
        ) from e


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig) -> None:
        if not cfg.dir:
            raise ValueError("trainer.checkpoint.dir is not set")
        self.cfg = cfg
        self.root = Path(cfg.dir)

    def path_for(self, step: int) -> Path:
        return self.root / f"{PREFIX}{step:08d}"

    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "trainer.json").exists() else None

    def save(self, backend: TrainerBackend, state: TrainerState) -> Path | None:
        """Collective: every rank calls it; the main rank writes (with sharded checkpoints,
        every rank writes its shards). Returns the path on the main rank. No room left:
        `CheckpointDiskFull` (on every rank when a shard did not fit), nothing partial kept."""
        final = self.path_for(state.step)
        sharded = backend.sharded_checkpoints
        tmp = self.root / (
            f".{final.name}.tmp-shards" if sharded else f".{final.name}.tmp-{os.getpid()}"
        )
        try:
            return self._write(backend, state, final, tmp)
        except Exception as e:
            if not _is_disk_full(e, self.root):
                raise
            if backend.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(self.root).free
            raise CheckpointDiskFull(
                errno.ENOSPC,
                f"checkpoint of step {state.step} not written: disk full ({free} bytes free "
                f"after removing the partial checkpoint)",
                str(self.root),
            ) from e

    def _write(
        self, backend: TrainerBackend, state: TrainerState, final: Path, tmp: Path
    ) -> Path | None:
        if backend.sharded_checkpoints:
            if backend.is_main:
                self._fresh(tmp)
            full = backend.save_shards(tmp / SHARDS)  # starts with a barrier
        else:
            full = backend.full_state()
            if backend.is_main:
                self._fresh(tmp)
        if not backend.is_main:
            return None
        full["rng"] = rng_state()
        torch.save(full, tmp / "state.pt")
        fsync(tmp / "state.pt")
        _write_file(tmp / "trainer.json", json.dumps(state.to_json()).encode())
        fsync(tmp)
        if final.exists():  # a re-run of the same step after a resume: replace it
            shutil.rmtree(final)
        tmp.rename(final)
        pointer_tmp = self.root / f".{LATEST}.tmp-{os.getpid()}"
        _write_file(pointer_tmp, final.name.encode())
        os.replace(pointer_tmp, self.root / LATEST)
        fsync(self.root)
        self._prune(keep=final)
        log.info("checkpoint saved", extra={"step": state.step, "path": str(final)})
        return final

    def _fresh(self, tmp: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    def _prune(self, keep: Path) -> None:
        done = sorted(p for p in self.root.glob(f"{PREFIX}*") if p.is_dir())
        for old in done[: -self.cfg.keep_last]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(f".{PREFIX}*.tmp-*"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)

    def load(
        self, backend: TrainerBackend, path: Path | None = None, *, weights_only: bool = False
    ) -> TrainerState | None:
        """Collective; call it only when a checkpoint exists (`latest()` on the main rank).
        Restores the backend and the RNG; returns the trainer state (None on other ranks).
        `weights_only` (an export): a sharded checkpoint's optimizer state is left unread."""
        path = path or self.latest()
        if backend.is_main and path is None:
            raise FileNotFoundError(f"no checkpoint under {self.root}")
        full: dict[str, Any] | None = None
        state: TrainerState | None = None
        if backend.is_main and path is not None:
            full = _load_state(path / "state.pt")
            state = TrainerState.from_json(json.loads((path / "trainer.json").read_text()))
        if backend.sharded_checkpoints:
            # Every rank reads its own shards; the main rank names the directory.
            rest = None if full is None else {k: v for k, v in full.items() if k != "rng"}
            directory = path / SHARDS if path is not None else None
            backend.load_shards(directory, rest, weights_only=weights_only)
        else:
            backend.load_full_state(full)
        if full is not None:
            set_rng_state(full["rng"])
            log.info(
                "checkpoint loaded", extra={"step": state.step if state else 0, "path": str(path)}
            )
        return state
