"""Delta weight updates over gloo into a served engine (ours, bf16, a real process): the first
push is full, later ones carry only what changed, and the engine checks its weights against the
trainer's checksum after each; a mismatch or a stale base is resent in full and counted."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import load_file

from engine_client.client import InferenceClient
from searchr1.weightsync.baseline import Baseline
from searchr1.weightsync.delta import bits
from searchr1.weightsync.sender import WeightSender
from tests.support.engines import Target, engine_server

TOKEN = "delta-admin-token"
PROMPT = [1, 60, 61, 62]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Target]:
    env = {"SEARCHR1_INFERENCE__TORCH_ENGINE__DTYPE": "bfloat16"}
    with engine_server("torch", tiny_model_dir, admin_token=TOKEN, env=env) as t:
        yield t


@pytest.fixture
async def sender(server: Target) -> AsyncIterator[WeightSender]:
    engines = [InferenceClient(server.url, timeout_s=60, token=TOKEN)]
    s = WeightSender(engines, master_port=0, bucket_bytes=1 << 20, baseline=Baseline())
    s.baseline.verify_every = 1  # type: ignore[union-attr]
    await s.connect()
    yield s
    await s.close()


class Weights:
    """fp32 weights drifting by ~1e-4 of their size per step: a few % of bf16 elements move."""

    def __init__(self, model_dir: Path) -> None:
        self.tensors = load_file(str(model_dir / "model.safetensors"))
        self.gen = torch.Generator().manual_seed(0)

    def step(self) -> list[tuple[str, torch.Tensor]]:
        for t in self.tensors.values():
            t.mul_(1 + 1e-4 * torch.randn(t.shape, generator=self.gen))
        return list(self.tensors.items())


def resyncs(reason: str) -> float:
    value = REGISTRY.get_sample_value("searchr1_weight_delta_resyncs_total", {"reason": reason})
    return value or 0.0


def engine_metric(server: Target, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(lines[0].split()[1]) if lines else 0.0


async def test_delta_pushes_are_small_verified_and_serve(
    server: Target, sender: WeightSender, tiny_model_dir: Path
) -> None:
    weights = Weights(tiny_model_dir)
    client = InferenceClient(server.url, timeout_s=60, token=TOKEN)
    v0 = (await client.get_model_info())["weight_version"]
    first = await sender.push(weights.step(), version=v0 + 1)
    # Full (the model's layer norms start equal: each sent once, the others as aliases).
    assert not first.delta and first.raw_bytes - 1024 < first.bytes <= first.raw_bytes
    for k in range(2, 5):
        stats = await sender.push(weights.step(), version=v0 + k)
        assert stats.delta and stats.bytes * 4 < stats.raw_bytes, stats
        out = await client.generate(PROMPT, max_new_tokens=4, temperature=0)
        assert out.weight_version == v0 + k
    assert engine_metric(server, "searchr1_inference_weight_checksum_mismatches_total") == 0
    await client.aclose()


async def test_mismatch_and_stale_base_are_resent_in_full(
    server: Target, sender: WeightSender, tiny_model_dir: Path
) -> None:
    weights = Weights(tiny_model_dir)
    client = InferenceClient(server.url, timeout_s=60, token=TOKEN)
    v0 = (await client.get_model_info())["weight_version"]
    await sender.push(weights.step(), version=v0 + 1)
    assert (await sender.push(weights.step(), version=v0 + 2)).delta

    # The trainer's record of the engine drifts: the engine's checksum catches it.
    assert sender.baseline is not None
    name = next(iter(sender.baseline.tensors))
    bits(sender.baseline.tensors[name])[:3] ^= 1
    mismatches = engine_metric(server, "searchr1_inference_weight_checksum_mismatches_total")
    before = resyncs("checksum")
    stats = await sender.push(weights.step(), version=v0 + 3)
    assert not stats.delta and resyncs("checksum") == before + 1
    after = engine_metric(server, "searchr1_inference_weight_checksum_mismatches_total")
    assert after == mismatches + 1
    assert (await sender.push(weights.step(), version=v0 + 4)).delta  # verified again

    # Weights loaded from disk at the same version: the engine refuses the next delta.
    await client.update_weights_from_disk(str(tiny_model_dir), version=v0 + 4)
    before = resyncs("stale_base")
    stats = await sender.push(weights.step(), version=v0 + 5)
    assert not stats.delta and resyncs("stale_base") == before + 1
    assert (await sender.push(weights.step(), version=v0 + 6)).delta
    await client.aclose()


class PushSide:
    """What the trainer's pusher asks of a backend."""

    is_main = True

    def __init__(self, weights: Weights) -> None:
        self.weights = weights

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.tensors.items()


async def test_the_trainer_pushes_deltas_through_disk(
    server: Target, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from trainer.config import WeightPushConfig
    from trainer.weights import WeightPusher

    cfg = WeightPushConfig(
        mode="disk", delta="on", delta_verify_every=1, disk_dir=str(tmp_path),
        engine_urls=[server.url],
    )  # fmt: skip
    pusher = WeightPusher(cfg, token=TOKEN)
    weights = Weights(tiny_model_dir)
    backend = PushSide(weights)
    mismatches = engine_metric(server, "searchr1_inference_weight_checksum_mismatches_total")
    client = InferenceClient(server.url, timeout_s=60, token=TOKEN)
    v0 = (await client.get_model_info())["weight_version"]
    weights.step()
    first = await pusher.push(backend, v0 + 1)  # type: ignore[arg-type]
    weights.step()
    second = await pusher.push(backend, v0 + 2)  # type: ignore[arg-type]
    assert first is not None and second is not None and second.bytes * 4 < first.bytes
    assert (tmp_path / f"step_{v0 + 2:08d}" / "delta.safetensors").is_file()
    assert (await client.get_model_info())["weight_version"] == v0 + 2
    after = engine_metric(server, "searchr1_inference_weight_checksum_mismatches_total")
    assert after == mismatches  # both checked, both matched
    await client.aclose()
    await pusher.close()
