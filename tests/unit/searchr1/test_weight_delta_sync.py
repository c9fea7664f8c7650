"""Delta weight updates end to end in one process: the sender's baseline, the hand-over (real
shared memory into `searchr1.weightsync.handover_receiver`) and the disk path
(`delta.safetensors` into the `WeightLoader`), on a bf16 model with tied weights. After every
update the engine's weights are bit-identical to the trainer's; a refused or mismatching delta
is resent in full, counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY

from inference.memory import MemoryState
from searchr1.weightsync.baseline import Baseline, delta_capable, write_delta_dir
from searchr1.weightsync.delta import bits, state_checksum
from searchr1.weightsync.handover import HandoverSender
from searchr1.weightsync.handover_receiver import HandoverReceiver
from searchr1.weightsync.protocol import CHECKSUM_MISMATCH, STALE_BASE, EngineRefused
from searchr1.weightsync.receiver import CHECKSUM_MISMATCHES, WeightLoader


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 64)
        self.proj = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 512, bias=False)
        self.head.weight = self.embed.weight  # one Parameter under two names


class Trainer:
    """fp32 master weights taking real AdamW steps at lr 1e-6."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Tied()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6)

    def step(self) -> None:
        x = self.model.norm(self.model.proj(self.model.embed(torch.randint(0, 512, (64,)))))
        self.model.head(x).logsumexp(-1).mean().backward()
        self.opt.step()
        self.opt.zero_grad()

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.state_dict().items())  # tied: both names, one tensor


def engine_model() -> Tied:
    torch.manual_seed(1)  # other weights than the trainer's until the first update
    return Tied().to(torch.bfloat16)


def same_weights(engine: torch.nn.Module, trainer: Trainer) -> bool:
    want = [(n, t.to(torch.bfloat16)) for n, t in trainer.named()]
    return state_checksum(engine.state_dict().items()) == state_checksum(want)


class InProcessEngine:
    """Our engine's hand-over routes, in process: the sender's shared memory is real."""

    base_url = "in-process"

    def __init__(self) -> None:
        self.model = engine_model()
        self.loader = WeightLoader(self.model)
        self.memory = MemoryState(self.model, torch.device("cpu"), flush_kv=lambda: None)
        self.updates = HandoverReceiver(self.loader, self.memory)
        self.version = 0
        self._pending: int | None = None

    async def get_model_info(self) -> dict[str, Any]:
        return {"weight_version": self.version, "dtype": "bfloat16", "engine": "torch"}

    async def pause_generation(self, mode: str = "abort") -> None: ...

    async def continue_generation(self) -> None: ...

    async def begin_weight_update(self) -> bool:
        self.loader.begin_session()
        return True

    async def end_weight_update(self) -> None:
        try:
            self.loader.end_session()
        except ValueError as e:
            raise EngineRefused(str(e)) from None
        self.memory.weights_loaded()
        self.version = self._pending if self._pending is not None else self.version

    async def update_weights_from_tensor(
        self, serialized: list[str], *, load_format: str | None = None, **kw: Any
    ) -> None:
        from searchr1.weightsync.handover_receiver import parse_handover

        try:
            self.updates.apply(parse_handover(serialized, load_format))
        except ValueError as e:
            raise EngineRefused(str(e)) from None
        if kw.get("weight_version") is not None:
            self._pending = int(kw["weight_version"])


def resyncs(reason: str) -> float:
    value = REGISTRY.get_sample_value("searchr1_weight_delta_resyncs_total", {"reason": reason})
    return value or 0.0


async def test_handover_delta_is_small_and_bit_identical_every_step() -> None:
    trainer, engine = Trainer(), InProcessEngine()
    baseline = Baseline(verify_every=1)
    sender = HandoverSender([engine], bucket_bytes=40_000, baseline=baseline)  # several buckets
    first = await sender.push(trainer.named(), version=1)
    assert not first.delta and first.bytes < first.raw_bytes  # full, the tied weight sent once
    assert same_weights(engine.model, trainer) and engine.version == 1
    for step in range(2, 5):
        trainer.step()
        stats = await sender.push(trainer.named(), version=step)
        assert stats.delta and stats.bytes * 4 < stats.raw_bytes, stats
        assert same_weights(engine.model, trainer) and engine.version == step
        assert engine.memory.serving
    assert engine.model.head.weight is engine.model.embed.weight


async def test_a_tampered_baseline_fails_the_checksum_and_is_resent_in_full() -> None:
    trainer, engine = Trainer(), InProcessEngine()
    baseline = Baseline(verify_every=1)
    sender = HandoverSender([engine], baseline=baseline)
    await sender.push(trainer.named(), version=1)
    bits(baseline.tensors["proj.weight"])[:5] ^= 1  # the trainer's idea of the engine drifts
    before, mismatches = resyncs("checksum"), CHECKSUM_MISMATCHES._value.get()
    trainer.step()
    stats = await sender.push(trainer.named(), version=2)
    assert not stats.delta  # the full resend
    assert resyncs("checksum") == before + 1
    assert CHECKSUM_MISMATCHES._value.get() == mismatches + 1
    assert same_weights(engine.model, trainer) and engine.memory.serving


async def test_an_engine_at_another_state_refuses_the_delta_and_gets_it_in_full() -> None:
    trainer, engine = Trainer(), InProcessEngine()
    sender = HandoverSender([engine], baseline=Baseline(verify_every=0))
    await sender.push(trainer.named(), version=1)
    engine.loader.state = None  # e.g. loaded from disk meanwhile, at the same version
    before = resyncs("stale_base")
    trainer.step()
    stats = await sender.push(trainer.named(), version=2)
    assert not stats.delta and resyncs("stale_base") == before + 1
    assert same_weights(engine.model, trainer)


async def test_an_engine_at_another_version_gets_full_without_a_refusal() -> None:
    trainer, engine = Trainer(), InProcessEngine()
    sender = HandoverSender([engine], baseline=Baseline())
    await sender.push(trainer.named(), version=1)
    engine.version = 0  # restarted
    before = sum(resyncs(r) for r in ("checksum", "stale_base", "refused"))
    trainer.step()
    assert not (await sender.push(trainer.named(), version=2)).delta
    assert sum(resyncs(r) for r in ("checksum", "stale_base", "refused")) == before
    trainer.step()
    assert (await sender.push(trainer.named(), version=3)).delta


async def test_released_weights_take_no_delta() -> None:
    """Resumed without a backup, the weights are garbage: the delta is refused, full follows."""
    trainer, engine = Trainer(), InProcessEngine()
    sender = HandoverSender([engine], baseline=Baseline())
    await sender.push(trainer.named(), version=1)
    engine.memory.release(["weights"], running=0, waiting=0, paused=True)
    engine.memory.resume(["weights"])
    trainer.step()
    assert not (await sender.push(trainer.named(), version=2)).delta
    assert same_weights(engine.model, trainer) and engine.memory.serving


def test_sglang_gets_no_delta() -> None:
    assert delta_capable([{"engine": "torch"}, {"engine": "torch"}])
    assert not delta_capable([{"engine": "torch"}, {"weight_version": 3}])  # SGLang's answer
    assert not delta_capable([])


def test_disk_delta_directory_roundtrip(tmp_path: Path) -> None:
    trainer, model = Trainer(), engine_model()
    loader = WeightLoader(model)
    baseline = Baseline(verify_every=1)
    update = baseline.begin(1, delta=False)
    full = write_delta_dir(tmp_path / "s1", trainer.named(), update, torch.bfloat16)
    loader.load_from_disk(tmp_path / "s1")
    update.commit()
    assert same_weights(model, trainer) and loader.state == baseline.state
    trainer.step()
    update = baseline.begin(2, delta=True)
    small = write_delta_dir(tmp_path / "s2", trainer.named(), update, torch.bfloat16)
    assert small * 4 < full
    loader.load_from_disk(tmp_path / "s2")
    update.commit()
    assert same_weights(model, trainer)

    # Against a state the engine does not hold: refused, nothing changed.
    trainer.step()
    update = baseline.begin(3, delta=True)
    write_delta_dir(tmp_path / "s3", trainer.named(), update, torch.bfloat16)
    loader.state = "something-else"
    held = state_checksum(model.state_dict().items())
    with pytest.raises(ValueError, match=STALE_BASE):
        loader.load_from_disk(tmp_path / "s3")
    assert state_checksum(model.state_dict().items()) == held


def test_disk_delta_with_a_wrong_checksum_applies_nothing(tmp_path: Path) -> None:
    trainer, model = Trainer(), engine_model()
    loader = WeightLoader(model)
    baseline = Baseline(verify_every=1)
    update = baseline.begin(1, delta=False)
    write_delta_dir(tmp_path / "s1", trainer.named(), update, torch.bfloat16)
    loader.load_from_disk(tmp_path / "s1")
    update.commit()
    bits(baseline.tensors["norm.weight"])[0] ^= 1
    trainer.step()
    update = baseline.begin(2, delta=True)
    write_delta_dir(tmp_path / "s2", trainer.named(), update, torch.bfloat16)
    held = state_checksum(model.state_dict().items())
    with pytest.raises(ValueError, match=CHECKSUM_MISMATCH):
        loader.load_from_disk(tmp_path / "s2")
    assert state_checksum(model.state_dict().items()) == held and loader.state is None


@pytest.mark.parametrize(
    ("mode", "backend", "urls", "delta", "on"),
    [
        ("distributed", "gloo", ["http://10.0.0.5:30000"], "auto", True),
        ("distributed", "gloo", ["http://127.0.0.1:30000"], "auto", False),  # loopback
        ("distributed", "gloo", ["http://localhost:30000", "http://10.0.0.5:1"], "auto", True),
        ("distributed", "nccl", ["http://10.0.0.5:30000"], "auto", False),
        ("handover", "gloo", ["http://10.0.0.5:30000"], "auto", False),
        ("disk", "gloo", ["http://10.0.0.5:30000"], "auto", False),
        ("disk", "gloo", ["http://10.0.0.5:30000"], "on", True),
        ("distributed", "gloo", ["http://10.0.0.5:30000"], "off", False),
        ("none", "gloo", [], "on", False),
    ],
)
def test_where_delta_is_on_by_default(
    mode: str, backend: str, urls: list[str], delta: str, on: bool, tmp_path: Path
) -> None:
    from trainer.config import WeightPushConfig
    from trainer.weights import delta_enabled

    cfg = WeightPushConfig(
        mode=mode, backend=backend, engine_urls=urls, delta=delta, disk_dir=str(tmp_path)
    )
    assert delta_enabled(cfg) is on
