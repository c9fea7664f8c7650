"""`searchr1 demo --agent openai --quick`: the agent demo's whole path (~3 min on 2 cores):
world -> MiniLM index -> tiny model + function-calling warm start -> held-out eval through the
built-in loop -> GRPO on sessions of docs/examples/openai_agent.py:search_agent (Redis,
retriever, engine, trainer and `searchr1 gateway serve`; one `searchr1 agent run` per step, no
orchestrator) -> eval -> table and the demos' last line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.integration.test_demo_quick import run_quick_demo


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_agent_demo_trains_through_the_gateway(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc, values = run_quick_demo(out, "--agent", "openai")
    for key in ("em_before", "em_after", "searches_per_question", "wall_s"):
        float(values[key])
    assert values["engine"] == "torch"
    assert "held-out set: before vs after RL" in proc.stdout  # the demos' table

    stack = yaml.safe_load((out / "stack.yaml").read_text())
    assert stack["local"]["services"] == ["retriever", "inference", "trainer"]  # no orchestrator
    assert stack["agent"]["program"].endswith("docs/examples/openai_agent.py:search_agent")
    assert not (out / "logs" / "orchestrator.log").exists()
    # Both steps were trained on the agent's sessions: one `agent run` each, every session
    # rewarded, published by the gateway.
    steps = [json.loads(line) for line in (out / "train_metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    runs = (out / "agent_runs.txt").read_text().splitlines()
    assert len(runs) == 2 and all(r.startswith("sessions=128 rewarded=128 ") for r in runs)
    gateway = (out / "logs" / "gateway.log").read_text()
    assert "group published" in gateway
    before = json.loads((out / "eval_before.json").read_text())
    assert before["overall"]["n"] == 8
