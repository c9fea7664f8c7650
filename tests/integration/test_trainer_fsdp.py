"""FSDP2 over 2 ranks (gloo, CPU) gives the same update as one process.

The test launches this file under torchrun; as `__main__` it is the worker. Micro-batches are
small so the ranks get different numbers of them (one runs a zero-weight dummy pass), and two
steps run so the sharded optimizer state is exercised too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from searchr1.redis_server import free_port
from tests.unit.trainer.conftest import make_batch, tiny_qwen2
from trainer.config import BatchConfig, LossConfig, OptimConfig, TrainerConfig

ROOT = Path(__file__).resolve().parents[2]


def config() -> TrainerConfig:
    # eps=1 makes Adam's update ~ lr * g instead of ~ lr * sign(g), so float noise in
    # near-zero gradients is not amplified into lr-sized differences.
    return TrainerConfig(
        optim=OptimConfig(lr=0.5, eps=1.0, grad_clip=1.0),
        loss=LossConfig(kl_coef=0.05, entropy_coef=0.01),
        batch=BatchConfig(max_tokens_per_microbatch=40),
    )


def train(info) -> tuple[dict[str, torch.Tensor] | None, list[dict[str, float]]]:  # type: ignore[no-untyped-def]
    from trainer.backends.hf import HFBackend
    from trainer.step import train_on

    cfg = config()
    backend = HFBackend(tiny_qwen2(), cfg, info)
    metrics = [train_on(make_batch(2, 4, seed=s), backend, cfg) for s in (1, 2)]
    state = backend.full_state()
    return (state["model"] if backend.is_main else None), metrics


def _failure(proc: subprocess.CompletedProcess[str]) -> str:
    # torchrun's summary hides the cause: keep the ranks' error lines too.
    lines = proc.stderr.splitlines()
    causes = ("rror", "xception", "terminate", "what()", "gloo", "Abort", "Traceback")
    errors = [ln for ln in lines if any(c in ln for c in causes)][:40]
    return "\n".join([*errors, "...", *lines[-30:]])


def resume_diff(info, ckpt_dir: Path) -> float | None:  # type: ignore[no-untyped-def]
    """Sharded checkpoint round trip: save after 2 steps, load into a scrambled model, take a
    third step on both; max |difference| of the full parameters (main rank)."""
    from trainer.backends.hf import HFBackend
    from trainer.checkpoint import CheckpointManager, TrainerState
    from trainer.config import CheckpointConfig
    from trainer.step import train_on

    cfg = config()
    a = HFBackend(tiny_qwen2(), cfg, info)
    for s in (1, 2):
        train_on(make_batch(2, 4, seed=s), a, cfg)
    mgr = CheckpointManager(CheckpointConfig(dir=str(ckpt_dir)))
    mgr.save(a, TrainerState(step=2))
    torch.distributed.barrier()
    # The reference policy is the initial model (as from model.path on a real restart); the
    # policy's (sharded) parameters are scrambled, so they must come from the checkpoint.
    b = HFBackend(tiny_qwen2(), cfg, info)
    with torch.no_grad():
        for p in b.model.parameters():
            p.add_(1.0)
    mgr.load(b)
    for backend in (a, b):
        train_on(make_batch(2, 4, seed=3), backend, cfg)
    sa, sb = a.full_state()["model"], b.full_state()["model"]
    if info.rank != 0:
        return None
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


def worker(out: Path) -> None:
    from trainer.dist import init_distributed

    info = init_distributed("cpu")
    assert info.world_size == 2
    model_sd, metrics = train(info)
    diff = resume_diff(info, out / "ckpt")
    if info.rank == 0:
        torch.save(model_sd, out / "fsdp.pt")
        (out / "metrics.json").write_text(json.dumps({"steps": metrics, "resume_diff": diff}))
    # Tear down together: a rank that exits while the other still writes its files can abort
    # in gloo's teardown (seen once in CI: rank 1 SIGABRT, rank 0 then SIGTERMed).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # over 10 s: CI's slow phase (issue 45)
def test_two_rank_fsdp2_matches_one_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        __file__, str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, _failure(proc)

    from trainer.dist import DistInfo

    single_sd, single_metrics = train(DistInfo(0, 1, 0, torch.device("cpu")))
    assert single_sd is not None
    fsdp_sd = torch.load(tmp_path / "fsdp.pt")
    assert fsdp_sd.keys() == single_sd.keys()
    init = tiny_qwen2().state_dict()
    moved = 0.0
    for k, v in single_sd.items():
        assert torch.allclose(fsdp_sd[k], v, atol=1e-6, rtol=0), k
        moved = max(moved, float((v - init[k]).abs().max()))
    assert moved > 1e-3  # the update is not trivially zero
    report = json.loads((tmp_path / "metrics.json").read_text())
    # Resuming from a checkpoint gathered from shards continues exactly.
    assert report["resume_diff"] == 0.0
    fsdp_metrics = report["steps"]
    for one, two in zip(single_metrics, fsdp_metrics, strict=True):
        for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "train_tokens"):
            assert abs(one[key] - two[key]) < 1e-5, key


@pytest.mark.slow  # ~25 s: two ranks start a full trainer process each
def test_two_rank_trainer_run_from_the_bus(tmp_path, redis_server, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """`torchrun -m stack.cli trainer run` on 2 ranks: rank 0 reads the bus and broadcasts;
    per-step losses equal a 1-process replay of the same groups."""
    import yaml

    from tests.integration.test_trainer_loop import bus_counts, publish, trajectories
    from trainer.backends.hf import HFBackend, load_hf_model
    from trainer.dist import DistInfo
    from trainer.step import train_on

    trajs = trajectories(range(3))
    publish(redis_server.url, trajs)
    section = {
        "model": {"path": str(tiny_model_dir)},
        "http": {"port": free_port()},
        "batch": {"consume_block_s": 0.2, "max_tokens_per_microbatch": 16},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_steps": 2},
        "metrics_jsonl": str(tmp_path / "steps.jsonl"),
    }
    cfg_file = tmp_path / "stack.yaml"
    cfg_file.write_text(
        yaml.safe_dump(
            {
                "redis": {"url": redis_server.url},
                "bus": {"consumer": "c"},
                "run": {"groups_per_step": 1, "group_size": 4, "max_steps": 3},
                "trainer": section,
            }
        )
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "stack.cli", "trainer", "run", "--config", str(cfg_file),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, _failure(proc)
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000003"
    assert bus_counts(redis_server.url) == (0, 0)

    cfg = TrainerConfig(**section)
    backend = HFBackend(load_hf_model(cfg), cfg, DistInfo(0, 1, 0, torch.device("cpu")))
    for g, record in enumerate(records):
        replay = train_on([t for t in trajs if t.group_id == f"g{g}"], backend, cfg)
        assert record["trajectory_ids"] == [f"g{g}-s{k}" for k in range(4)]
        for key in ("loss", "kl", "grad_norm"):
            assert record[key] == pytest.approx(replay[key], rel=1e-4, abs=1e-6), (g, key)


@pytest.mark.slow  # ~60 s: two trainer ranks, two engine starts
def test_two_rank_trainer_resyncs_a_restarted_engine(
    tmp_path: Path,
    redis_server,
    tiny_model_dir: Path,  # type: ignore[no-untyped-def]
) -> None:
    """The real collective path of a re-sync: a 2-rank trainer pushes step 1, the engine
    restarts (version 0); while waiting for step 2's data rank 0 finds it behind and broadcasts
    a re-sync, both ranks join the push, and the engine serves version 1 again; then the run
    trains step 2, pushes it and exits 0."""
    import time

    import httpx
    import yaml

    from harness.inference_server import InferenceServerProcess
    from tests.integration.test_trainer_loop import bus_counts, publish, trajectories

    def version() -> int:
        return int(httpx.get(f"{engine.url}/get_model_info", timeout=5).json()["weight_version"])

    def wait_for(want: int, what: str, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert trainer.poll() is None, tail(log_path)
            try:
                if version() == want:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{what}: engine not at version {want} after {timeout_s} s")

    trajs = trajectories(range(2))
    port = free_port()
    engine = InferenceServerProcess(tiny_model_dir, port=port).start()
    section = {
        "model": {"path": str(tiny_model_dir)},
        "http": {"port": free_port()},
        "batch": {"consume_block_s": 0.2, "max_tokens_per_microbatch": 16},
        "weight_push": {
            "mode": "distributed", "engine_urls": [engine.url], "master_port": free_port(),
            "resync_check_s": 0.5,
        },
        "metrics_jsonl": str(tmp_path / "steps.jsonl"),
    }  # fmt: skip
    cfg_file = tmp_path / "stack.yaml"
    stack = {
        "redis": {"url": redis_server.url},
        "bus": {"consumer": "c"},
        "run": {"groups_per_step": 1, "group_size": 4, "max_steps": 2},
        "trainer": section,
    }
    cfg_file.write_text(yaml.safe_dump(stack))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "stack.cli", "trainer", "run", "--config", str(cfg_file),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log_path = tmp_path / "trainer.log"
    log_file = log_path.open("w")
    trainer = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        publish(redis_server.url, [t for t in trajs if t.group_id == "g0"])
        wait_for(1, "step 1 pushed")
        engine.stop()  # restarted: initial weights, version 0
        engine = InferenceServerProcess(tiny_model_dir, port=port).start()
        wait_for(1, "re-synced by both ranks")
        publish(redis_server.url, [t for t in trajs if t.group_id == "g1"])
        assert trainer.wait(timeout=180) == 0, tail(log_path)
        assert version() == 2
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        log_file.close()
        engine.stop()
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert bus_counts(redis_server.url) == (0, 0)


def tail(log_path: Path) -> str:
    return "\n".join(log_path.read_text().splitlines()[-60:])


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
