"""`searchr1 demo --trainer-backend`: the stack config it writes, its checks, its last line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from demos import cli as demo_cli
from demos.run import DemoConfig, write_stack_config
from stack import cli
from stack.config import load_config


def _rows(tmp_path: Path) -> dict[str, Path]:
    rows = {}
    for split in ("train", "test"):
        rows[split] = tmp_path / f"{split}.jsonl"
        rows[split].write_text('{"q": 1}\n' * 40)
    return rows


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_stack_config_names_the_trainer_backend(tmp_path: Path, backend: str) -> None:
    cfg = DemoConfig.quick_mode(tmp_path / "out", trainer_backend=backend)
    (tmp_path / "out").mkdir()
    path = write_stack_config(cfg, tmp_path / "index", tmp_path / "model", _rows(tmp_path))
    assert yaml.safe_load(path.read_text())["trainer"]["backend"] == backend
    loaded = load_config(path)  # the whole stack config still validates
    assert loaded.trainer.backend == backend
    assert loaded.trainer.megatron.tp * loaded.trainer.megatron.pp == 1  # one process


def test_two_engines_are_listed_for_the_orchestrator_and_the_trainer(tmp_path: Path) -> None:
    cfg = DemoConfig.quick_mode(tmp_path / "out", engines=2)
    (tmp_path / "out").mkdir()
    loaded = load_config(write_stack_config(cfg, tmp_path / "i", tmp_path / "m", _rows(tmp_path)))
    port = loaded.inference.http.port
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    assert loaded.local.inference_replicas == 2
    assert loaded.engines.urls == urls == loaded.trainer.weight_push.engine_urls


def test_dynamic_sampling_and_a_training_seed_reach_the_stack_config(tmp_path: Path) -> None:
    plain_cfg = DemoConfig.quick_mode(tmp_path / "a")
    cfg = DemoConfig.quick_mode(tmp_path / "b", dynamic_sampling=True, train_seed=3)
    for c in (plain_cfg, cfg):
        c.out_dir.mkdir()
    plain = load_config(
        write_stack_config(plain_cfg, tmp_path / "i", tmp_path / "m", _rows(tmp_path))
    )
    loaded = load_config(write_stack_config(cfg, tmp_path / "i", tmp_path / "m", _rows(tmp_path)))
    rollout = loaded.orchestrator.rollout
    assert (
        rollout.over_sampling == loaded.run.groups_per_step // 4
        and rollout.group_filter == "reward_std"
    )
    assert loaded.orchestrator.epochs > plain.orchestrator.epochs  # room for filtered steps
    assert loaded.orchestrator.data.seed == loaded.trainer.model.seed == 3
    assert plain.orchestrator.rollout.group_filter is None and plain.orchestrator.data.seed == 0


def test_colocated_placement_reaches_the_stack_config(tmp_path: Path) -> None:
    cfg = DemoConfig.quick_mode(tmp_path / "out", placement="colocated")
    (tmp_path / "out").mkdir()
    loaded = load_config(write_stack_config(cfg, tmp_path / "i", tmp_path / "m", _rows(tmp_path)))
    push = loaded.trainer.weight_push
    assert loaded.placement == "colocated" and loaded.orchestrator.mode == "sync"
    assert push.mode == "handover" and push.release_engines_while_training
    assert push.handover_format == "searchr1"
    assert loaded.trainer.offload_between_steps == ["optimizer", "reference"]


def test_unknown_placement_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.app, ["demo", "--out", str(tmp_path), "--placement", "x"])
    assert result.exit_code == 2 and "--placement" in result.output


def test_a_warm_start_to_reuse_must_exist(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli.app,
        ["demo", "--quick", "--out", str(tmp_path / "o"), "--warm-start-from", str(tmp_path)],
    )
    assert result.exit_code == 2 and "no model-warm/" in result.output
    assert not (tmp_path / "o").exists()  # refused before any work


def test_unknown_trainer_backend_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli.app, ["demo", "--quick", "--out", str(tmp_path), "--trainer-backend", "deepspeed"]
    )
    assert result.exit_code == 2
    assert "--trainer-backend must be hf or megatron" in result.output
    assert not any(tmp_path.iterdir())  # refused before any work


def test_megatron_without_megatron_core_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo_cli, "_importable", lambda module: module != "megatron.core")
    result = CliRunner().invoke(
        cli.app, ["demo", "--quick", "--out", str(tmp_path), "--trainer-backend", "megatron"]
    )
    assert result.exit_code == 2
    assert "megatron-core" in result.output


def test_importable_with_a_missing_parent_package() -> None:
    assert demo_cli._importable("json")
    assert not demo_cli._importable("no_such_package_here.core")


def test_last_line_names_engine_and_trainer_backend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo_cli.print_demo_summary({"em_before": 0.1, "em_after": 0.5}, tmp_path, "torch", "megatron")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "em_before=0.100 em_after=0.500 engine=torch trainer_backend=megatron"


@pytest.mark.parametrize(
    ("args", "steps"),
    [([], 30), (["--task", "multi-tool"], 20), (["--task", "multi-tool", "--steps", "5"], 5)],
)
def test_grpo_steps_default_by_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], steps: int
) -> None:
    seen: list[DemoConfig] = []
    monkeypatch.setattr(demo_cli, "run_demo", lambda cfg: seen.append(cfg) or {})
    monkeypatch.setattr(demo_cli, "run_supervised", lambda run: run())
    monkeypatch.setattr(demo_cli, "print_demo_summary", lambda *a: None)
    result = CliRunner().invoke(cli.app, ["demo", "--out", str(tmp_path), *args])
    assert result.exit_code == 0, result.output
    assert [cfg.rl_steps for cfg in seen] == [steps]
