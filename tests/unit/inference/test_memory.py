"""`inference.memory` (release/resume of parameters and cache) and the described hand-over
format of `searchr1.weightsync.handover`, in process."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from inference.memory import MemoryReleased, MemoryState, normalize_tags, parameter_bytes
from searchr1.weightsync.handover import Handover, Packed, opened


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)
        self.head = torch.nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight  # one Parameter under two names
        self.register_buffer("table", torch.arange(4.0))


def state(cpu_backup: bool = False) -> tuple[Tied, MemoryState, list[int]]:
    torch.manual_seed(0)
    model = Tied()
    flushed: list[int] = []
    mem = MemoryState(
        model, torch.device("cpu"), cpu_backup=cpu_backup, flush_kv=lambda: flushed.append(1)
    )
    return model, mem, flushed


def test_tags_follow_sglang() -> None:
    assert normalize_tags(None) == normalize_tags([]) == ["kv_cache", "weights", "cuda_graph"]
    assert normalize_tags(["weights", "weights"]) == ["weights"]
    with pytest.raises(ValueError, match="tags: unknown"):
        normalize_tags(["gpu"])


def test_release_frees_storage_keeps_ties_and_resume_awaits_weights() -> None:
    model, mem, flushed = state()
    assert parameter_bytes(model) == 100 * 16 * 4  # the tied weight counted once
    mem.release(["weights", "kv_cache"], running=0, waiting=0, paused=False)
    assert parameter_bytes(model) == 0 and flushed == [1]
    assert model.head.weight is model.embed.weight
    with pytest.raises(MemoryReleased, match="resume_memory_occupation"):
        mem.refuse_generation()
    with pytest.raises(ValueError, match="weights are released"):
        mem.require_weights("update")
    mem.resume(["weights", "kv_cache"])
    assert model.embed.weight.shape == (100, 16) and model.head.weight is model.embed.weight
    assert parameter_bytes(model) == 100 * 16 * 4
    assert mem.awaiting_weights and not mem.serving
    with pytest.raises(MemoryReleased, match="weight update"):
        mem.refuse_generation()
    mem.weights_loaded()
    assert mem.serving
    assert torch.equal(model.table, torch.arange(4.0))  # buffers stay


def test_cpu_backup_restores_content() -> None:
    model, mem, _ = state(cpu_backup=True)
    before = model.embed.weight.detach().clone()
    mem.release(None, running=0, waiting=0, paused=False)
    mem.resume(None)
    assert mem.serving and torch.equal(model.embed.weight, before)


def test_release_needs_an_idle_engine_and_no_double_release() -> None:
    _, mem, _ = state()
    with pytest.raises(ValueError, match="idle engine"):
        mem.release(None, running=2, waiting=0, paused=True)
    with pytest.raises(ValueError, match="idle engine"):
        mem.release(None, running=0, waiting=3, paused=False)
    mem.release(["kv_cache"], running=0, waiting=3, paused=True)  # a paused queue may wait
    with pytest.raises(ValueError, match="already released"):
        mem.release(["kv_cache"], running=0, waiting=0, paused=True)
    with pytest.raises(ValueError, match="not released"):
        mem.resume(["weights"])


def test_packed_bucket_round_trips_through_shared_memory() -> None:
    tensors = [
        ("a", torch.randn(3, 5)),
        ("b", torch.arange(7, dtype=torch.int64)),
        ("c", torch.randn(2, 2).to(torch.bfloat16)),
    ]
    packed = Packed(tensors, torch.device("cpu"))
    try:
        handover = Handover.model_validate_json(packed.describe())
        assert all(t.offset % 64 == 0 for t in handover.tensors)
        with opened(handover) as views:
            for name, t in tensors:
                assert torch.equal(views[name], t)
    finally:
        packed.close()
    with pytest.raises(ValueError, match="does not exist"), opened(handover):
        pass  # the sender unlinked it


def test_description_is_validated_before_anything_is_opened() -> None:
    packed = Packed([("a", torch.zeros(4))], torch.device("cpu"))
    try:
        spec = json.loads(packed.describe())
        for name in ("../../etc/passwd", "psm_123", "searchr1_ho_XYZ"):
            bad = {**spec, "buffer": {**spec["buffer"], "name": name}}
            with pytest.raises(ValidationError):
                Handover.model_validate(bad)
        far = {**spec, "tensors": [{**spec["tensors"][0], "offset": 64}]}
        with (
            pytest.raises(ValueError, match="outside the buffer"),
            opened(Handover.model_validate(far)),
        ):
            pass
        with pytest.raises(ValidationError):
            Handover.model_validate({**spec, "tensors": [{**spec["tensors"][0], "dtype": "obj"}]})
    finally:
        packed.close()


def test_a_cuda_ipc_buffer_on_an_engine_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for engines without it")
    buffer = {
        "kind": "cuda_ipc", "size": 16, "device": 0, "handle": "AA==",
        "storage_size_bytes": 16, "storage_offset_bytes": 0, "ref_counter_handle": "AA==",
        "ref_counter_offset": 0, "event_handle": "AA==", "event_sync_required": False,
    }  # fmt: skip
    spec = {"name": "a", "dtype": "float32", "shape": [4], "offset": 0}
    handover = Handover.model_validate({"buffer": buffer, "tensors": [spec]})
    with pytest.raises(ValueError, match="without CUDA"), opened(handover):
        pass
