"""The orchestrator writes its rollout log (steps, validations) and serves the inspector at /ui."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from inspector.rundir import Ref, RunDir
from orchestrator.config import OrchestratorConfig
from orchestrator.rollout import Rollout
from orchestrator.rollout_log import RolloutLog
from orchestrator.server import LoopState, create_app
from orchestrator.tools.search import SearchTool
from searchr1.bus import TrajectoryBus
from searchr1.sections import BusConfig
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_loop import PROMPTS, build
from tests.unit.orchestrator.test_rollout import TURN1, TURN2, FakeRetriever


@pytest.fixture
async def bus(redis_server):  # type: ignore[no-untyped-def]
    b = TrajectoryBus.from_url(redis_server.url, BusConfig())
    yield b
    await b.close()


async def test_loop_logs_steps_and_validations(tokenizer, bus, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2], weight_version=0)
    cfg = OrchestratorConfig()
    greedy = Rollout(
        cfg.rollout, engine, SearchTool(FakeRetriever(), cfg.search), tokenizer, greedy=True
    )
    orch = build(
        tokenizer,
        bus,
        engine,
        validation=(greedy, PROMPTS[:3]),
        mode="async",
        max_staleness=5,
        eval_every_steps=1,
        data={"val_path": "unused.jsonl"},
        rollout_log={"run_dir": str(tmp_path), "groups_per_step": 1},
    )
    orch.rollout_log = RolloutLog(orch.cfg.rollout_log, tokenizer)
    await orch.run()

    run = RunDir(tmp_path)
    steps = run.rollout_steps()
    assert [s["step"] for s in steps] == [0, 1]
    assert all(len(s["groups"]) == 2 for s in steps)  # every group's rewards, logged or not
    assert steps[0]["summary"]["samples"] == 4.0
    train = run.trajectories(kind="train")
    assert len(train) == 2 * 2  # one group of 2 samples per step
    row = run.trajectory(Ref.parse(train[0]["ref"]))
    assert row["num_searches"] == 1 and row["turns"][0]["query"]
    assert row["extracted_answer"] == "Paris" and row["reward"] == 1.0
    assert row["token_texts"] and len(row["token_texts"]) == row["response_len"]
    evals = run.evaluations()
    assert [e["label"] for e in evals] == ["step 0", "step 1", "step 2"]
    assert all(e["overall"]["n"] == 3 for e in evals)
    assert len(run.eval_rows(evals[-1]["eval_id"])) == 3


def test_ui_needs_a_run_dir() -> None:
    with pytest.raises(ValueError, match=r"rollout_log\.run_dir"):
        OrchestratorConfig.model_validate({"ui": True})
    assert OrchestratorConfig().ui is False


def test_inspector_mounted_at_ui(tmp_path: Path) -> None:
    (tmp_path / "train_metrics.jsonl").write_text(json.dumps({"step": 1, "kl": 0.1}) + "\n")
    unused: Any = None  # the pages never touch the clients
    client = TestClient(create_app(unused, unused, unused, LoopState(), ui_run_dir=str(tmp_path)))
    page = client.get("/ui/")
    assert page.status_code == 200 and 'href="/ui/trajectories"' in page.text
    assert client.get("/ui/static/uPlot.iife.min.js").status_code == 200
    assert client.get("/ui/api/curves").json()["last_step"] == 1
    assert client.get("/ui/").status_code == 200
    without = TestClient(create_app(unused, unused, unused, LoopState()))
    assert without.get("/ui/").status_code == 404
