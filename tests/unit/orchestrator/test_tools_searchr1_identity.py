"""The Search-R1 rollout's output, pinned: what the trainer gets is byte-identical across the
tool-interface refactor (issue 30).

The digests below were recorded from the code before `orchestrator/tools/` existed, with the
scripted engine of the rollout tests: prompt ids, response ids, loss mask, logprobs, response
text, the turn records and every engine call's input ids and sampling arguments. A change to any
of them is a change of the Search-R1 protocol, not a refactor. The Rollout built from a bare
`SearchTool` (as before) and from the default `rollout.tools` (as the service wires it) agree.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from orchestrator.config import RolloutConfig, SearchConfig
from orchestrator.prompt import prompt_token_ids
from orchestrator.rollout import Rollout
from orchestrator.sample import Sample, new_group
from orchestrator.tokenizer import rust_tokenizer
from orchestrator.tools.registry import build_toolbox
from orchestrator.tools.search import SearchTool
from orchestrator.trajectory import to_trajectory
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_rollout import PROMPT, TURN1, TURN2, FakeRetriever
from tests.unit.orchestrator.test_search import FAST, Flaky

# scenario -> (engine turns, rollout config, search config, retriever kind)
SCENARIOS: dict[str, tuple[list[str], dict[str, Any], dict[str, Any], str]] = {
    "search_then_answer": ([TURN1, TURN2], {}, {"topk": 2}, "fake"),
    "invalid_then_answer": (["I think maybe", TURN2], {}, {"topk": 2}, "fake"),
    "two_searches_original": (
        [TURN1, TURN1, TURN2],
        {"turn_semantics": "original", "max_turns": 2},
        {"topk": 2},
        "fake",
    ),
    "observation_truncated": ([TURN1, TURN2], {"observation_max_tokens": 12}, {}, "fake"),
    "search_failure": ([TURN1, TURN2], {}, {"limits": {"max_attempts": 2, **FAST}}, "flaky"),
    "length_turn": ([TURN1, TURN2], {"max_tokens_per_turn": 5, "max_turns": 3}, {}, "fake"),
}

# Recorded at commit 0903823 (before the refactor).
DIGESTS = {
    "search_then_answer": "5cd1e754fd8d8985818622a6cd7a1eb7715317958e8af28ad09bbbbb0c10a734",
    "invalid_then_answer": "46505b44cbc455c7d32d8013f7909f61e0bb4e2f6eea4a730ff6a1615f92b84b",
    "two_searches_original": "2f04b14f02a0da815a3b4421c96f32c27164e0983ea7392573db1bfa0fd17e06",
    "observation_truncated": "f6d9b6e171cfdfcc653d3989988d13eb06f0904e15a34edf724b23d872a32e20",
    "search_failure": "f554cd14148302a6e8e17aadbdbd12d8c431ade4bec4c5e36831524e83c8ef1e",
    "length_turn": "d959b7194cc616308d724826dc83d7c3246d2207c06d194243ff3d656070b33c",
}


def trainer_view(s: Sample, engine: ScriptedEngine) -> dict[str, Any]:
    """Everything of a sample that reaches the trainer or the engine, timing-free."""
    traj = to_trajectory(s)
    return {
        "prompt_ids": list(traj.prompt_token_ids),
        "response_ids": list(traj.response_token_ids),
        "loss_mask": list(traj.loss_mask),
        "logprobs": list(traj.rollout_logprobs),
        "text": s.response_text,
        "status": s.status.value if s.status else None,
        "infrastructure_failure": s.infrastructure_failure,
        "turns": [
            [
                t.index,
                t.action,
                t.query,
                list(t.doc_ids),
                t.error,
                t.tool_attempts,
                t.generated_tokens,
                t.observation_tokens,
                t.engine_finish_reason,
            ]
            for t in s.turns
        ],
        "calls": [{k: v for k, v in c.items() if k != "deadline_s"} for c in engine.calls],
    }


async def run_scenario(tokenizer: Any, name: str, *, toolbox: bool = False) -> dict[str, Any]:
    turns, cfg, search_cfg, kind = SCENARIOS[name]
    engine = ScriptedEngine(tokenizer, turns)
    client = FakeRetriever() if kind == "fake" else Flaky(10**9)
    tool = SearchTool(client, SearchConfig(**search_cfg))  # type: ignore[arg-type]
    rcfg = RolloutConfig(**cfg)
    tools = await build_toolbox(rcfg.tools, tool) if toolbox else tool
    rollout = Rollout(rcfg, engine, tools, rust_tokenizer(tokenizer))
    ids = prompt_token_ids(tokenizer, PROMPT.messages)
    [s] = new_group(PROMPT, ids, group_size=1, rollout_step=3, run_id="r")
    await rollout.run_sample(s)
    return trainer_view(s, engine)


def digest(view: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(view, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
async def test_searchr1_rollout_is_unchanged(tokenizer, name: str) -> None:  # type: ignore[no-untyped-def]
    view = await run_scenario(tokenizer, name)
    assert digest(view) == DIGESTS[name], json.dumps(view)[:2000]


@pytest.mark.parametrize("name", ["search_then_answer", "search_failure"])
async def test_the_service_wiring_gives_the_same(tokenizer, name: str) -> None:  # type: ignore[no-untyped-def]
    """As orchestrator.wiring builds it: the toolbox of the default `rollout.tools`."""
    view = await run_scenario(tokenizer, name, toolbox=True)
    assert digest(view) == DIGESTS[name], json.dumps(view)[:2000]
