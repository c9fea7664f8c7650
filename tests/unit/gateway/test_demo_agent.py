"""`searchr1 demo --agent openai` (demos/agent.py): its warm start teaches exactly the ids
the agent's sessions record through the gateway; the built-in loop's evaluation renders the
same prompt; the pacer runs `searchr1 agent run` once per step, each after the engine serves
the weights trained on the groups published so far; the CLI refuses what it cannot run."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from demos import agent as da
from demos.run import tokenizer_corpus
from demos.warmstart import WarmStartConfig
from demos.world import Person, Town, World, generate_world, person_passage, town_passage
from orchestrator.tools.search import SearchTool
from searchr1.chat_template import prompt_token_ids
from searchr1.supervisor import ChildFailed
from stack import cli

EX = da.example()
SCHEMAS = EX.TOOLS[:1]


@pytest.fixture(scope="module")
def world_tok(tmp_path_factory: pytest.TempPathFactory) -> tuple[World, Any]:
    from transformers import AutoTokenizer

    from inference.tiny_model import make_tiny_model

    world = generate_world(0, n_people=60)
    extra = da.EXTRA_VOCAB_PER_NAME * (len(world.people) + len(world.towns))
    texts, vocab = tokenizer_corpus(world, da.vocabulary_texts(world, EX.SEARCH_INSTRUCTION), extra)
    model = make_tiny_model(tmp_path_factory.mktemp("agent-tok"), hidden_size=32, num_layers=1,
                            vocab_corpus=texts, vocab_size=vocab)  # fmt: skip
    return world, AutoTokenizer.from_pretrained(model)


def docs(passage: str) -> str:
    title, _, text = passage.partition("\n")
    return f"Doc 1(Title: {title}) {text}\n"


@pytest.mark.parametrize("hops", [1, 2])
async def test_the_warm_start_is_what_the_agents_sessions_record(  # type: ignore[no-untyped-def]
    make_rig, world_tok, hops: int
) -> None:
    world, tok = world_tok
    sampler = da.SearchCallSampler(world, tok, WarmStartConfig(topk=1), EX.SEARCH_INSTRUCTION,
                                   SCHEMAS)  # fmt: skip
    person = Person(world.people[0].name, world.towns[0].name, "poet")
    town = Town(person.town, world.countries[0])
    demo = sampler.demonstration(person, town, hops, None, docs)
    answer = town.country if hops == 2 else town.name
    eot = tok.eos_token
    turns = [t + eot for t in da.model_turns(person, town, hops, None)]
    assert len(turns) == hops + 1  # the searches, then the answer

    passages = {person.name: person_passage(person), town.name: town_passage(town)}

    async def search(arguments: dict[str, Any]) -> str:
        return docs(passages[arguments["query"]])

    rig = make_rig(turns, tok=tok)
    agent = EX.make_agent({"search": search}, SCHEMAS, instruction=EX.SEARCH_INSTRUCTION,
                          http_client=rig.http())  # fmt: skip
    async with rig.http() as http:
        r = await http.post("/v1/sessions", json={"id": "d1", "group_id": "g", "group_size": 1})
    kind = "country" if hops == 2 else "town"
    row = {"question": f'In which {kind} was "{person.name}" born?', "answer": answer}
    reward = await agent("http://gateway" + r.json()["base_path"], row)
    assert reward == 1.0
    await rig.gateway.end("d1", reward=reward)
    [traj] = await rig.published(1)
    assert list(traj.prompt_token_ids) == demo.prompt_ids
    assert list(traj.response_token_ids) == demo.response_ids
    assert list(traj.loss_mask) == demo.loss_mask
    assert sum(demo.loss_mask) < len(demo.loss_mask)  # the tool turns are masked out


def test_the_copy_phase_shows_the_question_alone(world_tok) -> None:  # type: ignore[no-untyped-def]
    """`Phase.short_prompt` reaches the demonstrations: the copy phase's prompt is the question
    alone, the later phases' the agent's whole first message (the instruction, then it)."""
    import random

    world, tok = world_tok
    cfg = WarmStartConfig(topk=1, copy_steps=1, copy_batch_size=4, format_steps=1, mix_steps=0,
                          batch_size=4)  # fmt: skip
    sampler = da.SearchCallSampler(world, tok, cfg, EX.SEARCH_INSTRUCTION, SCHEMAS)
    copy, fmt = cfg.phases()[:2]
    rng = random.Random(0)
    [short] = sampler.batches(copy, rng)
    [full] = sampler.batches(fmt, rng)
    assert all(EX.SEARCH_INSTRUCTION not in tok.decode(d.prompt_ids) for d in short)
    assert all(EX.SEARCH_INSTRUCTION in tok.decode(d.prompt_ids) for d in full)


def test_rows_the_runner_and_the_evaluation_read(world_tok, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    world, tok = world_tok
    rows = da.write_agent_rows(world, tmp_path, EX.SEARCH_INSTRUCTION)
    agent_rows = [json.loads(x) for x in rows["agent_train"].read_text().splitlines()]
    loop_rows = [json.loads(x) for x in rows["train"].read_text().splitlines()]
    assert len(agent_rows) == len(loop_rows) == len(world.split("train"))
    first, loop = agent_rows[0], loop_rows[0]
    assert first["question"].count('"') == 2 and first["answer"] in loop["reward_model"][
        "ground_truth"]["target"]  # fmt: skip
    # The evaluation's prompt is the agent's first message, rendered the same with the
    # built-in loop's schema of the search tool.
    message = loop["prompt"]
    text = da.prompt_text(first["question"], EX.SEARCH_INSTRUCTION)
    assert message == [{"role": "user", "content": text}]
    function = {"name": "search", "description": SearchTool.description,
                "parameters": SearchTool.parameters}  # fmt: skip
    loop_schema = [{"type": "function", "function": function}]
    assert prompt_token_ids(tok, message, loop_schema) == prompt_token_ids(tok, message, SCHEMAS)


class FakeStack:
    """The gateway's /metrics and the engine's /get_model_info, as the pacer reads them."""

    def __init__(self) -> None:
        self.published = 0
        self.dead = 0
        self.version = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            text = (
                f'searchr1_gateway_groups_total{{outcome="published"}} {self.published}\n'
                f'searchr1_gateway_groups_total{{outcome="dead_lettered"}} {self.dead}\n'
            )
            return httpx.Response(200, text=text)
        return httpx.Response(200, json={"weight_version": str(self.version)})


def pacer(tmp_path: Path, script: str, max_steps: int = 2) -> da.StepPacer:
    urls = {"gateway": "http://gw", "engine": "http://engine", "retriever": "http://r",
            "topk": "1", "agent_log": str(tmp_path / "agent")}  # fmt: skip
    rows = [{"id": str(i), "question": f"q{i}", "answer": "a"} for i in range(3)]
    p = da.StepPacer(tmp_path / "stack.yaml", rows, groups_per_step=2, group_size=4,
                     max_steps=max_steps, urls=urls, seed=0)  # fmt: skip
    p.command = lambda data: [sys.executable, "-c", script]  # type: ignore[method-assign]
    return p


def run_until_idle(p: da.StepPacer, client: httpx.Client, seconds: float = 3.0) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        p._next_poll = 0.0
        p.tick(client)
        if p._proc is None:
            return
        time.sleep(0.05)


def test_the_pacer_runs_one_agent_run_per_step_in_step_with_the_trainer(tmp_path: Path) -> None:
    fake = FakeStack()
    p = pacer(tmp_path, "print('sessions=8 rewarded=8 mean_reward=0.5000')")
    with httpx.Client(transport=httpx.MockTransport(fake.handler)) as client:
        run_until_idle(p, client)  # the first step's run starts at once and finishes
        assert p.batches == 1 and p.results == ["sessions=8 rewarded=8 mean_reward=0.5000"]
        rows = [
            json.loads(x) for x in (tmp_path / "agent/batch-000.jsonl").read_text().splitlines()
        ]
        assert len(rows) == 2  # groups_per_step rows, one group each
        run_until_idle(p, client)
        assert p.batches == 1  # its groups are not on the bus yet
        fake.published = 2
        run_until_idle(p, client)
        assert p.batches == 1  # the trainer has a step's groups: the engine must serve them
        fake.version = 1
        run_until_idle(p, client)
        assert p.batches == 2
        # One group of this step has nothing to train on (counted as finished): the trainer
        # cannot make its step of it alone, so the next run starts without waiting for one.
        fake.published, fake.dead = 3, 1
        run_until_idle(p, client)
        assert p.batches == 3
        fake.published = 5
        run_until_idle(p, client)
        assert p.batches == 3  # max_steps' groups are published: the trainer ends the stack
    every = [json.loads(x)["id"] for f in sorted((tmp_path / "agent").glob("*.jsonl"))
             for x in f.read_text().splitlines()]  # fmt: skip
    assert sorted(every[:3]) == ["0", "1", "2"]  # an epoch over the rows before repeating


def test_a_failed_agent_run_stops_the_demo_with_its_log(tmp_path: Path) -> None:
    fake = FakeStack()
    p = pacer(tmp_path, "import sys; print('error: the gateway said no'); sys.exit(1)")
    with (
        httpx.Client(transport=httpx.MockTransport(fake.handler)) as client,
        pytest.raises(ChildFailed, match="agent run") as e,
    ):
        run_until_idle(p, client)
    assert "error: the gateway said no" in e.value.log_tail


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--agent", "langgraph"], "--agent must be openai"),
        (["--agent", "openai", "--task", "multi-tool"], "--task cannot go with it"),
        (["--agent", "openai", "--engines", "2"], "--engines cannot go with it"),
    ],
)
def test_the_cli_refuses_what_the_agent_demo_cannot_run(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli.app, ["demo", *args])
    assert result.exit_code == 2
    assert message in result.output
