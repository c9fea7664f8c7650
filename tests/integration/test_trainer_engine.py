"""The trainer against a real inference engine process (the torch reference engine).

- the trainer's logprobs equal the engine's for the same tokens within 1e-4;
- after a training step, a distributed (gloo) push and a disk push each bump the engine's
  weight version, and the engine then computes exactly the trainer's new policy.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from engine_client.client import InferenceClient
from harness.inference_server import InferenceServerProcess
from protos.trajectory import SCHEMA_VERSION, Trajectory
from searchr1.redis_server import free_port
from searchr1.sections import RunConfig
from trainer.backend import Policy
from trainer.backends.hf import HFBackend, load_hf_model
from trainer.config import (
    LossConfig,
    ModelConfig,
    OptimConfig,
    TrainerConfig,
    WeightPushConfig,
)
from trainer.dist import DistInfo
from trainer.step import build_sequences, sequence_logprobs, train_on
from trainer.weights import WeightPusher

PROMPTS = [[1, 60, 61, 62], [1, 70, 71], [1, 80, 81, 82, 83]]
CPU = DistInfo(0, 1, 0, torch.device("cpu"))
RUN = RunConfig(groups_per_step=len(PROMPTS), group_size=2, max_steps=1)  # one step of rollouts()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[InferenceServerProcess]:
    with InferenceServerProcess(tiny_model_dir) as s:
        yield s


@pytest.fixture
async def client(server: InferenceServerProcess) -> AsyncIterator[InferenceClient]:
    c = InferenceClient(server.url, timeout_s=60)
    yield c
    await c.aclose()


async def rollouts(client: InferenceClient, seed: int) -> list[Trajectory]:
    out = []
    for g, prompt in enumerate(PROMPTS):
        for k in range(2):
            r = await client.generate(prompt, max_new_tokens=10, seed=seed + 10 * g + k)
            assert r.logprobs is not None
            t = Trajectory(
                schema_version=SCHEMA_VERSION,
                trajectory_id=f"{seed}-{g}-{k}",
                group_id=f"{seed}-{g}",
                group_size=2,
                prompt_token_ids=prompt,
                response_token_ids=r.output_ids,
                loss_mask=bytes([1] * len(r.output_ids)),
                rollout_logprobs=r.logprobs,
                has_rollout_logprobs=True,
                weight_version=r.weight_version,
            )
            t.reward.total = float(k)
            out.append(t)
    return out


def max_diff(cfg: TrainerConfig, backend: HFBackend, trajs: list[Trajectory]) -> float:
    samples, _, _ = build_sequences(trajs, cfg)
    olds = sequence_logprobs(samples, backend, Policy.CURRENT, cfg)
    return max(
        float((old - s.rollout_logprobs).abs().max())  # type: ignore[operator]
        for s, old in zip(samples, olds, strict=True)
    )


async def test_logprobs_match_engine_and_pushes_update_it(
    client: InferenceClient, server: InferenceServerProcess, tiny_model_dir: Path, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    cfg = TrainerConfig(
        model=ModelConfig(path=str(tiny_model_dir)),
        optim=OptimConfig(lr=1e-2),
        loss=LossConfig(kl_coef=0.0),
    )
    backend = HFBackend(load_hf_model(cfg), cfg, CPU)
    trajs = await rollouts(client, seed=0)
    assert max_diff(cfg, backend, trajs) < 1e-4

    metrics = train_on(trajs, backend, cfg)
    assert metrics["logprob_diff/trainer_vs_rollout_abs_max"] < 1e-4
    assert max_diff(cfg, backend, trajs) > 1e-3  # the policy moved; the engine has old weights

    dist_push = WeightPusher(
        WeightPushConfig(mode="distributed", engine_urls=[server.url], master_port=free_port())
    )
    try:
        res = await dist_push.push(backend, step=1)
    finally:
        await dist_push.close()
    # The version is the trainer's step, never "engine + 1".
    assert res is not None and res.weight_version == 1 and res.bytes > 0
    fresh = await rollouts(client, seed=100)
    assert all(t.weight_version == 1 for t in fresh)
    assert max_diff(cfg, backend, fresh) < 1e-4

    train_on(fresh, backend, cfg)
    disk_push = WeightPusher(
        WeightPushConfig(mode="disk", engine_urls=[server.url], disk_dir=str(tmp_path / "w"))
    )
    res = await disk_push.push(backend, step=2)
    assert res is not None and res.weight_version == 2
    assert (tmp_path / "w" / "step_00000002" / "model.safetensors").exists()
    assert (tmp_path / "w" / "step_00000002" / "tokenizer.json").exists()
    again = await rollouts(client, seed=200)
    assert max_diff(cfg, backend, again) < 1e-4


async def test_resume_pushes_the_checkpointed_weights(
    client: InferenceClient,
    server: InferenceServerProcess,
    tiny_model_dir: Path,
    tmp_path,
    redis_server,
) -> None:  # type: ignore[no-untyped-def]
    """The engine may hold weights of steps a crash rolled back: a resumed trainer pushes its
    checkpointed weights before training."""
    from searchr1.bus import TrajectoryBus
    from searchr1.sections import BusConfig
    from trainer.config import BatchConfig, CheckpointConfig
    from trainer.loop import TrainingLoop

    cfg = TrainerConfig(
        model=ModelConfig(path=str(tiny_model_dir)),
        optim=OptimConfig(lr=1e-2),
        loss=LossConfig(kl_coef=0.0),
        batch=BatchConfig(consume_block_s=0.1),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt")),
        weight_push=WeightPushConfig(
            mode="disk", engine_urls=[server.url], disk_dir=str(tmp_path / "w")
        ),
    )
    trajs = await rollouts(client, seed=300)
    bus = TrajectoryBus.from_url(redis_server.url, BusConfig(consumer="t"))
    await bus.publish(trajs)
    trained = HFBackend(load_hf_model(cfg), cfg, CPU)
    await TrainingLoop(cfg, trained, CPU, run=RUN, bus=bus).run()  # step 1, pushed and checkpointed
    v1 = (await client.get_model_info())["weight_version"]

    # Someone (a lost step) changed the engine's weights: push the initial model instead.
    other = HFBackend(load_hf_model(cfg), cfg, CPU)
    await WeightPusher(cfg.weight_push).push(other, step=99)
    assert max_diff(cfg, trained, await rollouts(client, seed=400)) > 1e-3

    resumed = TrainingLoop(cfg, HFBackend(load_hf_model(cfg), cfg, CPU), CPU, run=RUN, bus=bus)
    assert await resumed.resume()
    await resumed.run()  # max_steps reached: no training, only the realigning push
    # The engines serve the checkpoint's step again (they used to end one version ahead per
    # crash: every push was "engine + 1").
    assert v1 == 1 and resumed.status.weight_version == 1
    assert (await client.get_model_info())["weight_version"] == 1
    assert max_diff(cfg, trained, await rollouts(client, seed=500)) < 1e-4
    await bus.close()


def loop_config(tiny_model_dir: Path, push: WeightPushConfig) -> TrainerConfig:
    from trainer.config import BatchConfig

    return TrainerConfig(
        model=ModelConfig(path=str(tiny_model_dir)),
        optim=OptimConfig(lr=1e-2),
        loss=LossConfig(kl_coef=0.0),
        batch=BatchConfig(consume_block_s=0.1),
        weight_push=push,
    )


async def test_a_failed_push_is_retried_until_the_engine_has_the_step(
    client: InferenceClient, tiny_model_dir: Path, redis_server
) -> None:  # type: ignore[no-untyped-def]
    """Sync mode used to deadlock after one failed push: the trainer logged it and went on
    while the orchestrator waited forever for that version."""
    from searchr1.bus import TrajectoryBus
    from searchr1.sections import BusConfig
    from trainer.loop import TrainingLoop

    port = free_port()  # no engine there yet: the first pushes fail
    cfg = loop_config(
        tiny_model_dir,
        WeightPushConfig(
            mode="distributed", engine_urls=[f"http://127.0.0.1:{port}"],
            master_port=free_port(), retry_backoff_s=0.5, retry_deadline_s=120,
        ),
    )  # fmt: skip
    bus = TrajectoryBus.from_url(redis_server.url, BusConfig(consumer="t"))
    await bus.publish(await rollouts(client, seed=600))
    loop = TrainingLoop(cfg, HFBackend(load_hf_model(cfg), cfg, CPU), CPU, run=RUN, bus=bus)
    task = asyncio.create_task(loop.run())
    try:
        while not task.done() and loop.status.step < 1:
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)  # a few failed attempts
        assert not task.done()
        with InferenceServerProcess(tiny_model_dir, port=port) as late:
            await asyncio.wait_for(task, timeout=120)
            async with InferenceClient(late.url) as c:
                assert (await c.get_model_info())["weight_version"] == 1
        assert loop.status.weight_version == 1
        assert loop.status.last_metrics["weight_push/retries"] >= 1
    finally:
        task.cancel()
        await loop.pusher.close()
        await bus.close()


async def test_a_push_that_keeps_failing_stops_the_trainer(
    client: InferenceClient, tiny_model_dir: Path, redis_server, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from searchr1.bus import TrajectoryBus
    from searchr1.sections import BusConfig
    from trainer.loop import TrainingLoop, WeightPushFailed

    cfg = loop_config(
        tiny_model_dir,
        WeightPushConfig(
            mode="disk", engine_urls=[f"http://127.0.0.1:{free_port()}"],  # nobody there
            disk_dir=str(tmp_path / "w"), retry_backoff_s=0.2, retry_deadline_s=1.0,
        ),
    )  # fmt: skip
    bus = TrajectoryBus.from_url(redis_server.url, BusConfig(consumer="t"))
    await bus.publish(await rollouts(client, seed=700))
    loop = TrainingLoop(cfg, HFBackend(load_hf_model(cfg), cfg, CPU), CPU, run=RUN, bus=bus)
    try:
        with pytest.raises(WeightPushFailed, match="retry_deadline_s"):
            await asyncio.wait_for(loop.run(), timeout=60)
    finally:
        await bus.close()


# one rank: CI's slow phase (20 s, issue 45); two ranks cover the push and the re-sync broadcast
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2])
async def test_an_engine_that_restarted_gets_the_current_weights_again(
    client: InferenceClient,
    tiny_model_dir: Path,
    redis_server,  # type: ignore[no-untyped-def]
    ranks: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restarted engine serves version 0: sync rollouts waited for the trainer's version
    forever while the trainer waited for their data. With several ranks (the push is
    collective) rank 0 broadcasts a re-sync instead of a batch and every rank pushes; here
    rank 0's side of it, the broadcast standing in for the followers."""
    from searchr1.bus import TrajectoryBus
    from searchr1.sections import BusConfig
    from trainer import loop as loop_module
    from trainer.loop import TrainingLoop

    info = CPU
    broadcasts: list[object] = []
    if ranks == 2:
        info = DistInfo(0, 2, 0, torch.device("cpu"))

        def broadcast(obj: object, _: DistInfo) -> object:
            broadcasts.append(obj)
            return obj

        monkeypatch.setattr(loop_module, "broadcast_object", broadcast)

    port = free_port()
    cfg = loop_config(
        tiny_model_dir,
        WeightPushConfig(
            mode="distributed", engine_urls=[f"http://127.0.0.1:{port}"],
            master_port=free_port(), resync_check_s=0.5,
        ),
    )  # fmt: skip
    run = RUN.model_copy(update={"max_steps": 2})  # data for one step: then it waits
    bus = TrajectoryBus.from_url(redis_server.url, BusConfig(consumer="t"))
    await bus.publish(await rollouts(client, seed=800))
    backend = HFBackend(load_hf_model(cfg), cfg, CPU)
    loop = TrainingLoop(cfg, backend, info, run=run, bus=bus)
    engine = InferenceServerProcess(tiny_model_dir, port=port).start()
    task = asyncio.create_task(loop.run())
    try:
        while loop.status.weight_version < 1:
            assert not task.done()
            await asyncio.sleep(0.1)
        engine.stop()  # the engine restarts: back to the initial weights, version 0
        engine = InferenceServerProcess(tiny_model_dir, port=port).start()
        async with InferenceClient(engine.url) as c:
            for _ in range(300):
                if (await c.get_model_info())["weight_version"] == 1:
                    break
                await asyncio.sleep(0.1)
            assert (await c.get_model_info())["weight_version"] == 1
            again = await rollouts(c, seed=900)
        assert max_diff(cfg, backend, again) < 1e-4  # the trainer's weights, not the initial
        if ranks == 2:
            assert loop_module.RESYNC in broadcasts  # every rank was told to push
    finally:
        loop.stop_event.set()
        await asyncio.wait_for(task, 60)
        await loop.pusher.close()
        engine.stop()
        await bus.close()
