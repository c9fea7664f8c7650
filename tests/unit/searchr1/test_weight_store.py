"""The weight store (searchr1.weightsync.store): versions written as a full snapshot then
deltas, read back bit for bit (from scratch or from a version held), pruned, and refused
(counted, never served) when a file or the manifest is corrupt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from searchr1.weightsync.delta import state_checksum
from searchr1.weightsync.store import (
    INDEX,
    StoreCorrupt,
    StoreEmpty,
    WeightStoreReader,
    WeightStoreWriter,
    read_index,
)


class Drift:
    """fp32 'trainer' weights moving a little each step; the store holds them as bf16."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.gen = g
        self.tensors = {
            "embed.weight": torch.randn(64, 32, generator=g),
            "layer.0.weight": torch.randn(32, 32, generator=g),
            "layer.0.bias": torch.randn(32, generator=g),
            "steps": torch.zeros(1, dtype=torch.int64),
        }

    def step(self) -> list[tuple[str, torch.Tensor]]:
        for name, t in self.tensors.items():
            if t.is_floating_point() and name != "layer.0.bias":  # the bias stays: "same"
                t.mul_(1 + 1e-3 * torch.randn(t.shape, generator=self.gen))
        self.tensors["steps"] += 1
        return list(self.tensors.items())

    def held_fp32(self) -> str:
        return state_checksum(self.tensors.items())

    def held(self) -> str:
        """The checksum of the weights as the engines hold them (bf16)."""
        return state_checksum(
            (n, t.to(torch.bfloat16) if t.is_floating_point() else t)
            for n, t in self.tensors.items()
        )


def errors(reason: str) -> float:
    got = REGISTRY.get_sample_value("searchr1_weight_store_errors_total", {"reason": reason})
    return got or 0.0


def test_versions_round_trip_bit_for_bit(tmp_path: Path) -> None:
    writer = WeightStoreWriter(tmp_path, full_every=4, keep_full=2)
    reader = WeightStoreReader(tmp_path)
    with pytest.raises(StoreEmpty):
        reader.read()
    drift = Drift()
    kinds = []
    for v in range(1, 7):
        kinds.append(writer.publish(v, drift.step(), dtype=torch.bfloat16, state=f"s{v}").kind)
        snap = reader.read(dtype=torch.bfloat16)
        assert (snap.version, snap.checksum, snap.state) == (v, drift.held(), f"s{v}")
        assert snap.tensors["steps"].item() == v and snap.tensors["embed.weight"].dtype == (
            torch.bfloat16
        )
    # A full snapshot, deltas, a full one again at full_every.
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta"]
    index = read_index(tmp_path)
    full = next(e for e in index.entries if e.kind == "full")
    delta = next(e for e in index.entries if e.kind == "delta")
    assert delta.bytes * 2 < full.bytes  # a delta is small
    assert index.dtype == "bfloat16"


def test_a_reader_holding_a_version_reads_only_the_deltas_since(tmp_path: Path) -> None:
    writer = WeightStoreWriter(tmp_path, full_every=100, max_chain_ratio=100)
    reader = WeightStoreReader(tmp_path)
    drift = Drift()
    writer.publish(1, drift.step())
    first = reader.read()
    writer.publish(2, drift.step())
    writer.publish(3, drift.step())
    kept = {n: t.clone() for n, t in first.tensors.items()}
    later = reader.read(have=first)
    assert later.version == 3 and later.files == 2 and later.checksum == drift.held_fp32()
    assert all(torch.equal(kept[n], t) for n, t in first.tensors.items())  # left as it was
    assert reader.read(have=later) is later  # nothing new


def test_retention_keeps_the_newest_full_snapshots_and_what_follows(tmp_path: Path) -> None:
    writer = WeightStoreWriter(tmp_path, full_every=2, keep_full=2)
    drift = Drift()
    for v in range(1, 8):
        writer.publish(v, drift.step())
    index = read_index(tmp_path)
    # full at 1, 3, 5, 7: the newest two kept, with the delta between them.
    assert [(e.version, e.kind) for e in index.entries] == [(5, "full"), (6, "delta"), (7, "full")]
    on_disk = sorted(p.name for p in tmp_path.glob("v*.safetensors"))
    assert on_disk == sorted(e.file for e in index.entries)
    assert not list(tmp_path.glob(".*part"))
    assert WeightStoreReader(tmp_path).read(version=6).version == 6


def test_going_back_drops_the_later_versions(tmp_path: Path) -> None:
    writer = WeightStoreWriter(tmp_path)
    drift = Drift()
    for v in (1, 2, 3):
        writer.publish(v, drift.step())
    again = WeightStoreWriter(
        tmp_path, max_chain_ratio=100
    )  # a trainer resumed from step 2's checkpoint
    assert again.publish(2, drift.step()).kind == "full"
    assert [e.version for e in read_index(tmp_path).entries] == [1, 2]
    assert WeightStoreReader(tmp_path).read().checksum == drift.held_fp32()
    # The same version with the same weights (a retried push): nothing written.
    assert again.publish(2, drift.tensors.items()).kind == "kept"
    assert again.publish(3, drift.step()).kind == "delta"


def test_a_corrupt_file_is_refused_and_counted(tmp_path: Path) -> None:
    writer = WeightStoreWriter(tmp_path, full_every=100)
    drift = Drift()
    writer.publish(1, drift.step())
    writer.publish(2, drift.step())
    delta = tmp_path / read_index(tmp_path).entries[-1].file
    data = bytearray(delta.read_bytes())
    data[-5] ^= 0xFF
    delta.write_bytes(bytes(data))
    before = errors("sha256")
    with pytest.raises(StoreCorrupt, match="sha256"):
        WeightStoreReader(tmp_path).read()
    assert errors("sha256") == before + 1


def test_a_chain_that_does_not_rebuild_the_checksum_is_refused(tmp_path: Path) -> None:
    writer = WeightStoreWriter(tmp_path)
    drift = Drift()
    writer.publish(1, drift.step())
    index = json.loads((tmp_path / INDEX).read_text())
    index["entries"][0]["checksum"] = "0" * 32  # the manifest no longer matches the weights
    (tmp_path / INDEX).write_text(json.dumps(index))
    before = errors("checksum")
    with pytest.raises(StoreCorrupt, match="checksum"):
        WeightStoreReader(tmp_path).read()
    assert errors("checksum") == before + 1


def test_a_bad_manifest_a_missing_file_and_another_dtype_are_clear_errors(
    tmp_path: Path,
) -> None:
    writer = WeightStoreWriter(tmp_path)
    drift = Drift()
    writer.publish(1, drift.step(), dtype=torch.bfloat16)
    reader = WeightStoreReader(tmp_path)
    with pytest.raises(StoreCorrupt, match="holds bfloat16 weights; this engine serves float32"):
        reader.read(dtype=torch.float32)
    (tmp_path / read_index(tmp_path).entries[0].file).unlink()
    with pytest.raises(StoreCorrupt, match=r"No such file|v00000001"):
        reader.read()
    (tmp_path / INDEX).write_text('{"format": 1, "entries": [{"version": "x"}]}')
    before = errors("manifest")
    with pytest.raises(StoreCorrupt, match="not a weight store manifest"):
        reader.read()
    assert errors("manifest") == before + 1


def test_a_store_of_another_run_is_neither_pulled_nor_continued(tmp_path: Path) -> None:
    drift = Drift()
    WeightStoreWriter(tmp_path, run="old").publish(14, drift.step())
    with pytest.raises(StoreEmpty):
        WeightStoreReader(tmp_path, run="new").read()
    assert WeightStoreReader(tmp_path, run="old").read().version == 14
    WeightStoreWriter(tmp_path, run="new").publish(1, drift.step())
    index = read_index(tmp_path)
    assert index.run == "new" and [e.version for e in index.entries] == [1]
    assert len(list(tmp_path.glob("v*.safetensors"))) == 1  # the old run's files are gone
    assert WeightStoreReader(tmp_path, run="new").read().version == 1


def test_tied_tensors_are_stored_once_and_may_diverge_later(tmp_path: Path) -> None:
    writer = WeightStoreWriter(tmp_path, max_chain_ratio=100)
    reader = WeightStoreReader(tmp_path)
    embed = torch.randn(256, 64)
    named = {"embed": embed, "lm_head": embed.clone(), "norm.a": torch.ones(64),
             "norm.b": torch.ones(64)}  # fmt: skip
    writer.publish(1, named.items())
    full = read_index(tmp_path).entries[0]
    assert full.bytes < 256 * 64 * 4 * 1.2  # the embedding once
    snap = reader.read()
    assert snap.checksum == state_checksum(named.items()) and len(snap.tensors) == 4
    named["norm.b"] = named["norm.b"] + 0.5  # no longer equal to norm.a
    named["embed"][0] += 1
    named["lm_head"][0] += 1  # still tied
    writer.publish(2, named.items())
    assert read_index(tmp_path).entries[-1].kind == "delta"
    later = reader.read(have=snap)
    assert later.checksum == state_checksum(named.items())
    assert torch.equal(later.tensors["lm_head"], named["embed"])
    assert torch.equal(later.tensors["norm.a"], torch.ones(64))
