"""The trainer's pusher and its weight store (trainer.weight_push.store_dir): every pushed
version is written, in the engines' dtype; a store that cannot be written is counted and logged
and does not fail the push (the engines got the weights)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from searchr1.weightsync.store import WeightStoreReader, read_index
from trainer.config import WeightPushConfig
from trainer.weights import PushResult, WeightPusher


class Backend:
    is_main = True

    def __init__(self) -> None:
        self.tensors = {"w": torch.randn(8, 8), "b": torch.zeros(8)}

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()


def failures() -> float:
    return REGISTRY.get_sample_value("searchr1_trainer_weight_store_failures_total") or 0.0


async def test_each_push_is_published_and_a_failed_write_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = WeightPushConfig(
        mode="distributed", engine_urls=["http://127.0.0.1:9"], store_dir=str(tmp_path / "s"),
        dtype="bfloat16",
    )  # fmt: skip
    pusher = WeightPusher(cfg)

    async def pushed(backend: object, step: int, named: object, start: float) -> PushResult:
        return PushResult(step, 0.0, 0)

    monkeypatch.setattr(pusher, "_push", pushed)
    backend = Backend()
    for step in (1, 2):
        backend.tensors["w"] += 1
        assert (await pusher.push(backend, step)).weight_version == step  # type: ignore[arg-type,union-attr]
    snap = WeightStoreReader(tmp_path / "s").read(dtype=torch.bfloat16)
    assert snap.version == 2 and torch.equal(snap.tensors["w"], backend.tensors["w"].bfloat16())
    assert [e.kind for e in read_index(tmp_path / "s").entries] == ["full", "delta"]

    assert pusher.store is not None
    (tmp_path / "file").write_text("")
    pusher.store.root = tmp_path / "file" / "store"  # cannot be written
    before = failures()
    assert (await pusher.push(backend, 3)).weight_version == 3  # type: ignore[arg-type,union-attr]
    assert failures() == before + 1
