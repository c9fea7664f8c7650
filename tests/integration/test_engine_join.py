"""An engine added to a running run joins by pulling (issue 44 item 2), with real processes: a
trainer's pusher publishes each version to the weight store and pushes it (gloo) to the engine
it has; a second engine started mid-run pulls the current version from the store, reports
ready, announces itself, and serves weights bit-identical to the trainer's, while the first
engine keeps serving without a pause; the next push reaches both; a stopped engine leaves the
push set."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from engine_client.client import InferenceClient
from harness.inference_server import InferenceServerProcess
from searchr1.redis_server import RedisServer
from searchr1.weightsync.baseline import RESYNCS
from searchr1.weightsync.registry import EngineRegistry, registry_key
from searchr1.weightsync.store import read_index
from trainer.config import WeightPushConfig
from trainer.weights import WeightPusher

TOKEN = "join-admin-token"
PROMPT = [1, 60, 61, 62]
STREAM = "searchr1:trajectories"


class Trainer:
    """What the pusher asks of a backend: weights drifting a little each step."""

    is_main = True

    def __init__(self, model_dir: Path) -> None:
        self.tensors = load_file(str(model_dir / "model.safetensors"))
        self.gen = torch.Generator().manual_seed(0)

    def step(self) -> None:
        """A few tensors move each step (fp32: every element of those): deltas stay small."""
        for t in list(self.tensors.values())[:3]:
            t.mul_(1 + 1e-3 * torch.randn(t.shape, generator=self.gen))

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()


def checksum(url: str) -> tuple[int, str]:
    body = httpx.get(
        f"{url}/weights_checksum", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
    ).json()
    return int(body["weight_version"]), body["checksum"]


async def serve_without_pause(url: str, stop: asyncio.Event) -> list[float]:
    """Generate on `url` back to back until `stop`; each call's seconds (any failure raises)."""
    took = []
    async with InferenceClient(url, timeout_s=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            await client.generate(PROMPT, max_new_tokens=4, temperature=0)
            took.append(time.perf_counter() - t0)
    return took


@pytest.mark.slow  # 17-53 s of engine processes: CI's slow phase (issue 45)
async def test_an_engine_added_mid_run_pulls_the_current_weights(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    store = tmp_path / "store"
    first = InferenceServerProcess(tiny_model_dir, admin_token=TOKEN).start()
    registry = EngineRegistry.from_url(redis_server.url, registry_key(STREAM))
    cfg = WeightPushConfig(
        mode="distributed", master_port=0, engine_urls=[first.url], store_dir=str(store),
        store_full_every=3, timeout_s=60, delta="on",
    )  # fmt: skip
    pusher = WeightPusher(cfg, token=TOKEN, registry=registry, run="run")  # run.id default
    trainer = Trainer(tiny_model_dir)
    second: InferenceServerProcess | None = None
    try:
        pushed = []
        for step in (1, 2, 3):
            trainer.step()
            pushed.append(await pusher.push(trainer, step))  # type: ignore[arg-type]
        index = read_index(store)
        assert [e.kind for e in index.entries] == ["full", "delta", "delta"]
        assert checksum(first.url) == (3, index.entries[-1].checksum)

        # A second engine joins while the first one serves.
        stop = asyncio.Event()
        serving = asyncio.create_task(serve_without_pause(first.url, stop))
        await asyncio.sleep(0.5)
        join_env = {
            "SEARCHR1_INFERENCE__JOIN__STORE_DIR": str(store),
            "SEARCHR1_INFERENCE__JOIN__ANNOUNCE": "true",
            "SEARCHR1_INFERENCE__JOIN__ANNOUNCE_TTL_S": "6",
            "SEARCHR1_REDIS__URL": redis_server.url,
        }
        t0 = time.perf_counter()
        second = InferenceServerProcess(tiny_model_dir, admin_token=TOKEN, env=join_env)
        await asyncio.to_thread(second.start)  # returns once /ready answers 200
        join_s = time.perf_counter() - t0
        stop.set()
        took = await serving
        # Bit-identical to the trainer's version 3 (the store's checksum is the trainer's
        # tensors as the engines hold them) and to the engine that got it by push.
        assert checksum(second.url) == (3, index.entries[-1].checksum)
        ready = httpx.get(f"{second.url}/ready", timeout=10).json()
        assert "store v3" in ready["checks"]["weights"]["detail"]
        assert len(took) >= 3 and max(took) < 5.0, took  # the first engine never paused
        assert await registry.live() == [second.url]

        # The next push reaches both; both serve it, bit for bit the same.
        # A delta for both: the joined engine took the pusher's delta state from the store.
        trainer.step()
        resyncs = sum(RESYNCS.labels(r)._value.get() for r in ("checksum", "stale_base", "refused"))
        fourth = await pusher.push(trainer, 4)  # type: ignore[arg-type]
        # (fp32: the moved tensors travel whole, the others as nothing; no resync below)
        assert fourth is not None and fourth.bytes < pushed[0].bytes * 0.6, (fourth, pushed)
        assert resyncs == sum(
            RESYNCS.labels(r)._value.get() for r in ("checksum", "stale_base", "refused")
        )
        assert pusher.urls == [first.url, second.url]
        want = read_index(store).entries[-1].checksum
        assert checksum(first.url) == checksum(second.url) == (4, want)
        async with InferenceClient(second.url, timeout_s=30) as client:
            assert (await client.generate(PROMPT, max_new_tokens=2)).weight_version == 4

        # Scaled down: the engine withdraws, the next push goes to the first one only.
        second.stop()
        second = None
        assert await registry.live() == []
        trainer.step()
        await pusher.push(trainer, 5)  # type: ignore[arg-type]
        assert pusher.urls == [first.url]
        assert checksum(first.url)[0] == 5
        print(f"join_s={join_s:.2f}")
    finally:
        await pusher.close()
        if second is not None:
            second.stop()
        first.stop()
