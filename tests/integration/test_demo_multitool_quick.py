"""`searchr1 demo --task multi-tool --quick`: the second task's whole path through the real
stack (~3 min on 2 cores): the years world -> MiniLM index -> tiny model + function-calling
warm start -> held-out eval -> GRPO with search and PyPI's mcp-server-calculator (an MCP server
process per orchestrator) -> eval -> table and key=value line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from harness.inspector_run import check_inspector_pages
from tests.integration.test_demo_quick import run_quick_demo


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_multitool_demo_runs_the_whole_stack(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc, values = run_quick_demo(out, "--task", "multi-tool")
    for key in ("em_before", "em_after", "searches_per_question", "wall_s",
                "calculator_calls_per_question"):  # fmt: skip
        float(values[key])
    assert "calculator calls / question" in proc.stdout

    stack = yaml.safe_load((out / "stack.yaml").read_text())
    rollout = stack["orchestrator"]["rollout"]
    assert rollout["action_format"] == "function_calling"
    assert rollout["tools"][1]["mcp"]["include"] == ["calculate"]
    # the orchestrator started the MCP server and found its tool
    orch = (out / "logs" / "orchestrator.log").read_text()
    assert "MCP server connected" in orch and "calculate" in orch
    steps = [json.loads(line) for line in (out / "train_metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    before = json.loads((out / "eval_before.json").read_text())
    assert before["overall"]["n"] == 8
    seen = check_inspector_pages(out)
    assert seen["steps"] == 2 and seen["evaluations"] == 2
