"""A TP=2 Megatron trainer pushes to the reference engine through the same `WeightSender` path
as the HF backend: after its push the engine generates exactly what it generates after an HF
backend pushes the same weights (greedy tokens equal, logprobs within 1e-5)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from engine_client.client import InferenceClient
from harness.inference_server import InferenceServerProcess
from searchr1.redis_server import free_port
from tests.support.torchrun import torchrun, torchrun_env

pytest.importorskip("megatron.core")

WORKER = Path(__file__).resolve().parents[1] / "unit/trainer/megatron/push_worker.py"
PROMPTS = [[1, 60, 61, 62], [1, 70, 71], [1, 80, 81, 82, 83]]


async def greedy(url: str) -> list[tuple[list[int], list[float]]]:
    async with InferenceClient(url, timeout_s=60) as c:
        out = []
        for p in PROMPTS:
            r = await c.generate(p, max_new_tokens=8, temperature=0.0)
            out.append((r.output_ids, list(r.logprobs or [])))
        return out


@pytest.mark.slow
async def test_megatron_push_equals_hf_push(tiny_model_dir: Path, tmp_path: Path) -> None:
    from trainer.backends.hf import HFBackend, load_hf_model
    from trainer.config import TrainerConfig, WeightPushConfig
    from trainer.dist import DistInfo
    from trainer.weights import WeightPusher

    with InferenceServerProcess(tiny_model_dir) as server:
        before = await greedy(server.url)
        section = {
            "backend": "megatron",
            "megatron": {"tp": 2},
            "model": {"path": str(tiny_model_dir)},
            "optim": {"lr": 1e-2},
            "loss": {"kl_coef": 0.0},
            "weight_push": {
                "mode": "distributed",
                "engine_urls": [server.url],
                "master_port": free_port(),
            },
        }
        stack = tmp_path / "stack.yaml"
        stack.write_text(yaml.safe_dump({"trainer": section}))
        export = tmp_path / "trained"
        cmd = torchrun(2, str(WORKER), str(stack), str(export))
        proc = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-6000:]
        after_megatron = await greedy(server.url)

        # The same weights from the HF backend (loaded from the Megatron trainer's export).
        cfg = TrainerConfig(model={"path": str(export)}, loss={"kl_coef": 0.0})
        hf = HFBackend(load_hf_model(cfg), cfg, DistInfo(0, 1, 0, torch.device("cpu")))
        pusher = WeightPusher(
            WeightPushConfig(mode="distributed", engine_urls=[server.url], master_port=free_port())
        )
        try:
            res = await pusher.push(hf, step=2)
        finally:
            await pusher.close()
        assert res is not None and res.weight_version == 2
        after_hf = await greedy(server.url)

    assert [o for o, _ in after_megatron] == [o for o, _ in after_hf]
    for (_, a), (_, b) in zip(after_megatron, after_hf, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    # The push changed what the engine computes (the step moved the weights).
    assert any(
        max(abs(x - y) for x, y in zip(a, b, strict=False)) > 1e-3
        for (_, a), (_, b) in zip(before, after_megatron, strict=True)
    )
