"""Issue 43: an agent written as a plain `openai`-client program that calls its tools itself
(docs/examples/openai_agent.py) gives, through the gateway, the trajectory the built-in loop
gives for the same turns: the same prompt ids, response ids and loss mask, id for id."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from orchestrator.config import RolloutConfig, SearchConfig
from orchestrator.rollout import Rollout
from orchestrator.sample import Prompt, new_group
from orchestrator.tools.calculator import Calculator
from orchestrator.tools.search import SearchTool
from orchestrator.tools.toolbox import Toolbox, entry
from tests.unit.gateway.conftest import EOT, call_text
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_rollout import FakeRetriever

ROOT = Path(__file__).resolve().parents[3]
TURNS = [
    "I will look both up.\n" + call_text("search", query="Paris") + "\n"
    + call_text("search", query="Lyon") + EOT,
    call_text("calculator", expression="1969 - 1955") + EOT,
    "<answer> 14 </answer>" + EOT,
]  # fmt: skip
ROW = {"question": "How many years apart were Paris and Lyon founded?", "answer": "14"}


def example_agent() -> Any:
    spec = importlib.util.spec_from_file_location(
        "openai_agent", ROOT / "docs/examples/openai_agent.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def toolbox() -> Toolbox:
    search = SearchTool(FakeRetriever(), SearchConfig(topk=2))
    return Toolbox([entry(search, search.cfg.limits), entry(Calculator(), search.cfg.limits)])


async def test_an_openai_client_agent_trains_on_the_loops_own_ids(make_rig, qwen_tok) -> None:  # type: ignore[no-untyped-def]
    ex = example_agent()
    box = toolbox()
    # The built-in loop: function calling over the same tools, the same scripted turns.
    rollout = Rollout(
        RolloutConfig(action_format="function_calling", max_turns=3),
        ScriptedEngine(qwen_tok, TURNS),
        box,
        qwen_tok,
    )
    prompt_text = f"{ex.INSTRUCTION}\nQuestion: {ROW['question']}\n"
    prompt = Prompt("p0", "t", [{"role": "user", "content": prompt_text}], [ROW["answer"]])
    [loop] = new_group(prompt, rollout.prompt_ids(prompt.messages), group_size=1,
                       rollout_step=0, run_id="r")  # fmt: skip
    await rollout.run_sample(loop)
    assert [t.action for t in loop.turns] == ["tool", "tool", "answer"]

    # The same turns through the gateway, driven by the example program, which runs the same
    # tools itself and passes their schemas as any openai client does.
    rig = make_rig(TURNS)

    async def run_tool(name: str, arguments: dict[str, Any]) -> str:
        return (await box.call(name, arguments)).text

    tools = {n: (lambda a, n=n: run_tool(n, a)) for n in ("search", "calculator")}
    agent = ex.make_agent(tools, box.schemas(), http_client=rig.http())
    async with rig.http() as http:
        r = await http.post("/v1/sessions", json={"id": "a1", "group_id": "g", "group_size": 1})
    reward = await agent("http://gateway" + r.json()["base_path"], ROW)
    assert reward == 1.0
    await rig.gateway.end("a1", reward=reward)
    [traj] = await rig.published(1)

    assert list(traj.prompt_token_ids) == loop.prompt_ids
    assert list(traj.response_token_ids) == loop.response_ids
    assert list(traj.loss_mask) == loop.loss_mask
    assert [t.action for t in traj.turns] == ["tool", "tool", "answer"]
