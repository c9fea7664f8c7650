"""End to end, every part real: the reference engine process on the tiny model, Redis, the
gateway as `searchr1 gateway serve`, driven by the `openai` client (plain and streamed), the
OpenAI Agents SDK and `searchr1 agent run`; the trajectories read back from the bus.

Token-exact: each trajectory is the template's rendering of the first request, then the
engine's own output ids (mask 1; the same ids and logprobs the engine gives for that context
when asked directly, greedy), then the template's rendering of the next messages (mask 0).
(Tool calls need a policy that emits them on cue: tests/unit/gateway.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

from engine_client.client import InferenceClient
from protos.trajectory import Trajectory
from searchr1.bus import TrajectoryBus
from searchr1.chat_template import ToolTurns, prompt_token_ids
from searchr1.redis_server import RedisServer, free_port
from searchr1.sections import BusConfig
from searchr1.supervisor import ServiceProcess, ServiceSpec
from tests.support.engines import Target, engine_server

ROOT = Path(__file__).resolve().parents[2]
STREAM = "gateway-e2e"
set_tracing_disabled(True)


def searchr1_command() -> list[str]:
    exe = Path(sys.executable).parent / "searchr1"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "stack.cli"]


def service_env(redis: RedisServer) -> dict[str, str]:
    return {
        "SEARCHR1_REDIS__URL": redis.url,
        "SEARCHR1_BUS__STREAM": STREAM,
        # Greedy: the engine's answer to the same context, asked directly, is the same ids.
        "SEARCHR1_GATEWAY__TEMPERATURE": "0",
        # The package is found from the checkout (an editable install made before the gateway
        # existed does not map it).
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
    }


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Target]:
    with engine_server("torch", tiny_model_dir) as target:
        yield target


@pytest.fixture
def gateway_url(engine: Target, redis_server: RedisServer) -> Iterator[str]:
    port = free_port()
    command = [
        *searchr1_command(), "gateway", "serve",
        "--port", str(port), "--engine-url", engine.url,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    spec = ServiceSpec(
        "gateway", command, ready_url=f"{url}/ready", env=service_env(redis_server),
        ready_timeout_s=60,
    )  # fmt: skip
    with ServiceProcess(spec) as svc:
        yield url
        code = svc.stop()
    assert code == 0  # SIGTERM: a graceful exit


@pytest.fixture
async def bus(redis_server: RedisServer) -> AsyncIterator[TrajectoryBus]:
    b = TrajectoryBus.from_url(redis_server.url, BusConfig(stream=STREAM, consumer="t"))
    yield b
    await b.close()


async def consume(bus: TrajectoryBus, n: int, timeout_s: float = 20.0) -> list[Trajectory]:
    await bus.ensure_group()
    got: list[Trajectory] = []
    for _ in range(int(timeout_s / 0.5)):
        got += [d.trajectory for d in await bus.consume(n - len(got), block=0.5)]
        if len(got) >= n:
            break
    assert len(got) == n, f"{len(got)} of {n} trajectories on the bus"
    return got


def runs(mask: bytes) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for i, v in enumerate(mask):
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1], i + 1)
        else:
            out.append((v, i, i + 1))
    return out


async def assert_engine_exact(
    traj: Trajectory, tok: Any, engine: Target, later: list[list[dict[str, Any]]]
) -> list[str]:
    """Each mask-1 run is what the engine answers (greedy) to the context before it; each
    mask-0 run is the template's rendering of the next messages (`later[k]`) after it.
    Returns the model's turns, decoded."""
    ids = list(traj.prompt_token_ids) + list(traj.response_token_ids)
    offset = len(traj.prompt_token_ids)
    parts = runs(traj.loss_mask)
    assert [v for v, _, _ in parts] == [1, 0] * len(later) + [1]
    turns = []
    async with InferenceClient(engine.url, timeout_s=60) as client:
        for k, (_, a, b) in enumerate(parts[::2]):
            context, mine = ids[: offset + a], ids[offset + a : offset + b]
            direct = await client.generate(
                context, max_new_tokens=len(mine), temperature=0, top_k=1, return_logprob=True
            )
            assert direct.output_ids == mine
            ones = list(traj.rollout_logprobs[a:b])
            assert ones == pytest.approx(direct.logprobs, abs=1e-4)
            text = tok.decode(mine)
            turns.append(text)
            if k < len(later):
                _, c, d = parts[2 * k + 1]
                bridge = ToolTurns(tok, [], role="user").messages_text(text, later[k])
                assert ids[offset + c : offset + d] == tok.encode(bridge, add_special_tokens=False)
    return turns


async def test_openai_client_and_agents_sdk_through_the_real_stack(
    gateway_url: str, engine: Target, bus: TrajectoryBus
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine.model_dir)
    group = {"X-Group-Id": "e2e", "X-Group-Size": "2", "X-Row-Id": "row-0"}
    client = AsyncOpenAI(
        base_url=f"{gateway_url}/v1",
        api_key="unused",
        default_headers={"X-Session-Id": "chat", **group},
    )
    first = [{"role": "user", "content": "Who wrote the declaration?"}]
    r1 = await client.chat.completions.create(model="tiny", messages=first, max_tokens=12)
    follow = [{"role": "user", "content": "Where is the river?"}]
    history = [*first, r1.choices[0].message.model_dump(exclude_none=True), *follow]
    stream = await client.chat.completions.create(
        model="tiny", messages=history, max_tokens=10, stream=True
    )
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    agent = Agent(
        name="tiny",
        instructions="Answer briefly.",
        model=OpenAIChatCompletionsModel(
            "tiny", openai_client=AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused")
        ),
        model_settings=ModelSettings(max_tokens=8, extra_headers={"X-Session-Id": "sdk", **group}),
    )
    result = await Runner.run(agent, "What is the capital of France?")
    assert isinstance(result.final_output, str)

    async with httpx.AsyncClient(base_url=gateway_url) as http:
        for sid, reward in (("chat", 1.0), ("sdk", 0.0)):
            r = await http.post(f"/v1/sessions/{sid}/end", json={"reward": reward})
            assert r.json()["status"] == "ended"
        metrics = (await http.get("/metrics")).text
    assert 'searchr1_gateway_chat_completions_total{kind="turn"} 3.0' in metrics

    trajs = {t.metadata["session_id"]: t for t in await consume(bus, 2)}
    assert {(t.group_id, t.group_size, t.prompt_id) for t in trajs.values()} == {
        ("e2e", 2, "row-0")
    }
    chat, sdk = trajs["chat"], trajs["sdk"]
    assert (chat.reward.total, sdk.reward.total) == (1.0, 0.0)
    assert chat.temperature == 0.0 and chat.has_rollout_logprobs

    assert list(chat.prompt_token_ids) == prompt_token_ids(tok, first)
    turns = await assert_engine_exact(chat, tok, engine, [follow])
    eot = tok.eos_token
    assert [t.removesuffix(eot) for t in turns] == [r1.choices[0].message.content, streamed]

    sdk_messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert list(sdk.prompt_token_ids) == prompt_token_ids(tok, sdk_messages)
    [answer] = await assert_engine_exact(sdk, tok, engine, [])
    assert answer.removesuffix(eot) == result.final_output


def test_agent_run_cli_publishes_a_group_per_row(
    gateway_url: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    program = tmp_path / "agent.py"
    program.write_text(
        "from openai import AsyncOpenAI\n\n"
        "async def agent(base_url, row):\n"
        "    client = AsyncOpenAI(base_url=base_url, api_key='unused')\n"
        "    r = await client.chat.completions.create(\n"
        "        model='policy', max_tokens=6,\n"
        "        messages=[{'role': 'user', 'content': row['question']}])\n"
        "    return {'reward': float(bool(r.choices[0].message.content)), 'turns': 1}\n"
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "q1", "question": "Who is the president?"}\n')
    out = subprocess.run(
        [
            *searchr1_command(), "agent", "run",
            "--program", f"{program}:agent", "--data", str(rows),
            "--gateway-url", gateway_url, "-n", "2", "--run-id", "cli",
        ],
        env={**os.environ, **service_env(redis_server)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sessions=2 rewarded=2" in out.stdout

    async def read() -> list[Trajectory]:
        b = TrajectoryBus.from_url(redis_server.url, BusConfig(stream=STREAM, consumer="t"))
        try:
            return await consume(b, 2)
        finally:
            await b.close()

    import asyncio

    trajs = asyncio.run(read())
    assert sorted(t.trajectory_id for t in trajs) == ["cli.0.0/0", "cli.0.1/0"]
    assert {(t.group_id, t.group_size, t.prompt_id) for t in trajs} == {("cli/0", 2, "q1")}
    assert all(sum(t.loss_mask) == t.turns[0].generated_tokens > 0 for t in trajs)
