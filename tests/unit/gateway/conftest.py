"""Fixtures for the gateway's unit tests: the gateway's app in-process over a scripted policy
(a random tiny model never calls tools on cue; tests/integration/test_gateway.py runs the real
engine), the tiny model's tokenizer with Qwen2.5-Instruct's template (tool branches
included), and a real Redis for the bus."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from gateway.bridge import Renderer
from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.publish import Publisher
from gateway.server import create_app
from protos.trajectory import Trajectory
from searchr1.bus import TrajectoryBus
from searchr1.sections import BusConfig
from tests.unit.orchestrator.conftest import ScriptedEngine
from tests.unit.orchestrator.test_tools_function_calling import QWEN25_TEMPLATE

EOT = "<|im_end|>"


@pytest.fixture(scope="session")
def qwen_tok(tiny_model_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = QWEN25_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def redis_once(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One redis-server for the module's tests (each test gets its own stream)."""
    from searchr1.redis_server import RedisServer

    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.close()


@dataclass
class Rig:
    """A gateway over a scripted engine, its app, and the bus it publishes to."""

    gateway: Gateway
    engine: ScriptedEngine
    bus: TrajectoryBus
    app: Any

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://gateway"
        )

    def openai(self, session: str | None = None, **headers: str) -> AsyncOpenAI:
        hdrs = {"X-Session-Id": session, **headers} if session else dict(headers)
        return AsyncOpenAI(
            base_url="http://gateway/v1",
            api_key="unused",
            http_client=self.http(),
            default_headers=hdrs,
            max_retries=0,
        )

    async def published(self, n: int, timeout_s: float = 5.0) -> list[Trajectory]:
        """The next `n` trajectories on the bus (published in the background)."""
        await self.gateway.publisher.drain(timeout_s)
        await self.bus.ensure_group()
        got = await self.bus.consume(max(n, 1), block=0.2)
        return [d.trajectory for d in got]

    async def dead(self) -> list[dict[str, Any]]:
        await self.gateway.publisher.drain(5.0)
        return await self.bus.dead_letters()


@pytest.fixture
async def make_rig(
    qwen_tok: Any, redis_once: str, request: pytest.FixtureRequest
) -> AsyncIterator[Callable[..., Rig]]:
    buses: list[TrajectoryBus] = []
    stream = f"gw-{request.node.name}"[:80]

    def make(
        turns: list[str], tok: Any = None, context_length: int | None = None, **cfg: Any
    ) -> Rig:
        tok = tok or qwen_tok
        engine = ScriptedEngine(tok, turns)
        bus = TrajectoryBus.from_url(redis_once, BusConfig(stream=stream, consumer="test"))
        buses.append(bus)
        gw = Gateway(
            GatewayConfig(**cfg),
            engine,
            Renderer(tok),
            Publisher(bus),
            model_name="tiny",
            context_length=context_length,
        )
        return Rig(gw, engine, bus, create_app(gw))

    yield make
    for bus in buses:
        await bus.redis.delete(bus.stream, bus.dead_stream)
        await bus.close()


def tool_schema(name: str, **props: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name} tool",
            "parameters": {
                "type": "object",
                "properties": {k: {"type": v} for k, v in props.items()},
                "required": list(props),
            },
        },
    }


def call_text(name: str, **arguments: Any) -> str:
    import json

    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
