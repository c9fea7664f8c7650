"""The engine's join by pulling (inference.join.Joiner) on a real engine in-process: not ready
until it holds the store's newest version; a corrupt entry keeps it unready (counted, named in
the check) until the trainer publishes a good version; a version published while loading is
pulled too; a push that got there first is not taken back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import load_file

from inference.config import JoinConfig, TorchEngineConfig
from inference.engine import TorchEngine
from inference.join import Joiner
from searchr1.weightsync.store import WeightStoreWriter, read_index


@pytest.fixture
def engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:
    eng = TorchEngine(tiny_model_dir, TorchEngineConfig())
    yield eng
    eng.shutdown()


class Trainer:
    def __init__(self, model_dir: Path) -> None:
        self.tensors = load_file(str(model_dir / "model.safetensors"))
        self.gen = torch.Generator().manual_seed(1)

    def step(self) -> list[tuple[str, torch.Tensor]]:
        for t in self.tensors.values():
            t.mul_(1 + 1e-3 * torch.randn(t.shape, generator=self.gen))
        return list(self.tensors.items())


def store_errors(reason: str) -> float:
    got = REGISTRY.get_sample_value("searchr1_weight_store_errors_total", {"reason": reason})
    return got or 0.0


def joiner(engine: TorchEngine, store: Path) -> Joiner:
    cfg = JoinConfig(store_dir=str(store), poll_s=0.05)
    return Joiner(engine, cfg, advertise_url="http://127.0.0.1:1")


async def test_an_empty_store_means_the_initial_weights(
    engine: TorchEngine, tmp_path: Path
) -> None:
    j = joiner(engine, tmp_path)
    await j.run()
    assert "nothing in" in await j.check() and engine.weight_version == 0


async def test_ready_only_with_the_newest_version_bit_for_bit(
    engine: TorchEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    writer = WeightStoreWriter(tmp_path, max_chain_ratio=100)
    trainer = Trainer(tiny_model_dir)
    for v in (1, 2):
        writer.publish(v, trainer.step(), state=f"state-{v}")
    j = joiner(engine, tmp_path)
    with pytest.raises(RuntimeError, match="starting"):
        await j.check()
    await j.run()
    assert "store v2" in await j.check()
    got = await engine.run_command(engine.weights_checksum)
    assert got["weight_version"] == "2" and got["checksum"] == read_index(tmp_path).latest.checksum
    assert engine.weights.state == "state-2"  # the trainer's next delta push applies here


async def test_a_corrupt_entry_keeps_it_unready_until_a_good_version(
    engine: TorchEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    writer = WeightStoreWriter(tmp_path)
    trainer = Trainer(tiny_model_dir)
    writer.publish(1, trainer.step())
    path = tmp_path / read_index(tmp_path).entries[0].file
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    before = store_errors("sha256")
    j = joiner(engine, tmp_path)
    task = asyncio.create_task(j.run())
    await asyncio.sleep(0.5)
    with pytest.raises(RuntimeError, match="sha256"):
        await j.check()
    assert store_errors("sha256") > before and engine.weight_version == 0
    WeightStoreWriter(tmp_path).publish(2, trainer.step())  # the next version, full
    await asyncio.wait_for(task, 30)
    assert "store v2" in await j.check() and engine.weight_version == 2


async def test_a_push_that_got_there_first_stays(
    engine: TorchEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    WeightStoreWriter(tmp_path).publish(1, Trainer(tiny_model_dir).step())
    engine.scheduler.set_version(5)  # as if a push of version 5 had landed
    j = joiner(engine, tmp_path)
    await j.run()
    assert "a push got there first" in await j.check() and engine.weight_version == 5
