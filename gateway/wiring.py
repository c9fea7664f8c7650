"""Gateway wiring: the engine client, the served model's tokenizer, the bus, the `Gateway` and
its HTTP app (`serve`, what `searchr1 gateway serve` runs); and the agent runner over a
gateway (`run_agents`, what `searchr1 agent run` runs).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from engine_client.client import InferenceClient
from engine_client.pool import EnginePool
from gateway.bridge import Renderer
from gateway.config import AgentConfig, GatewayConfig
from gateway.core import Gateway
from gateway.publish import Publisher
from gateway.rubric import TaskRubric
from gateway.runner import AgentRunner, RunSummary, load_program, load_reward, load_rows
from gateway.server import create_app
from searchr1.bus import TrajectoryBus
from searchr1.engine_info import model_limits, wait_for_engine
from searchr1.sections import BusConfig, EnginesConfig
from searchr1.service import exit_cleanly_after_shutdown, uvicorn_server

log = logging.getLogger(__name__)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer  # heavy: loaded by the serving process only

    return AutoTokenizer.from_pretrained(path)


def make_engine(
    cfg: GatewayConfig, engines: EnginesConfig, token: SecretStr | None
) -> InferenceClient | EnginePool:
    """`gateway.engine_url` (a router or one engine), else our pool over `engines.urls` as
    the orchestrator's (a session's id is its routing key: its turns stay on one engine)."""

    def client(url: str) -> InferenceClient:
        return InferenceClient(
            url,
            deadline_s=cfg.engine_retry_s,
            max_connections=cfg.max_in_flight + 8,
            token=token.get_secret_value() if token else None,
        )

    if cfg.engine_url:
        return client(cfg.engine_url)
    return EnginePool(
        engines.urls,
        client,
        spill_at_in_flight=engines.spill_at_in_flight,
        probe_s=engines.probe_s,
        probe_timeout_s=engines.probe_timeout_s,
        probe_misses=engines.probe_misses,
    )


async def build_gateway(
    cfg: GatewayConfig, engine: InferenceClient | EnginePool, bus: TrajectoryBus
) -> Gateway:
    """A Gateway over the live engine (waited for) and its model's tokenizer."""
    info = await wait_for_engine(engine, cfg.engine_start_timeout_s)
    model_dir = cfg.tokenizer_path or str(info["model_path"])
    tokenizer = load_tokenizer(model_dir)
    vocab, context = model_limits(info, model_dir, tokenizer)
    engine.vocab_size = vocab  # ids the model cannot embed never reach the engine
    name = cfg.served_model_name or Path(str(info.get("model_path", "policy"))).name
    return Gateway(
        cfg,
        engine,
        Renderer(tokenizer),
        Publisher(bus, cfg.publish_timeout_s),
        model_name=name,
        context_length=context,
    )


def ready_checks(engine: InferenceClient | EnginePool, bus: TrajectoryBus) -> dict[str, Any]:
    async def engine_ready() -> str:
        info = await engine.get_model_info()
        return f"weight_version {info['weight_version']}"

    async def redis_ready() -> str:
        return str(await bus.ping())

    return {"engine": engine_ready, "redis": redis_ready}


async def serve(
    cfg: GatewayConfig,
    redis_url: str,
    bus_cfg: BusConfig,
    token: SecretStr | None,
    engines: EnginesConfig | None = None,
) -> int:
    """The service, until SIGTERM: live sessions are then dead-lettered, done groups
    published."""
    engine = make_engine(cfg, engines or EnginesConfig(), token)
    bus = TrajectoryBus.from_url(redis_url, bus_cfg)
    try:
        gateway = await build_gateway(cfg, engine, bus)
        app = create_app(gateway, token=token, ready_checks=ready_checks(engine, bus))
        server = uvicorn_server(app, cfg.http)
        exit_cleanly_after_shutdown()  # SIGTERM: drain, shut down, exit 0
        await server.serve()
        return 0
    finally:
        await engine.aclose()
        await bus.close()


async def run_agents(
    cfg: AgentConfig, *, run_id: str, group_size: int, token: SecretStr | None
) -> RunSummary:
    """Every row's group of sessions through the agent program (`searchr1 agent run`)."""
    if not cfg.program:
        raise ValueError("agent.program is not set (--program module:function)")
    if cfg.task and cfg.data_path:
        raise ValueError("agent.task (--task) and agent.data_path (--data): set one (the rows)")
    if not cfg.data_path and not cfg.task:
        raise ValueError("agent.data_path is not set (--data rows.jsonl, or --task NAME)")
    program = load_program(cfg.program)
    reward = load_reward(cfg.reward) if cfg.reward else None
    task = TaskRubric.load(cfg.task, cfg.task_options) if cfg.task else None
    if task is not None:
        rows = task.rows(cfg.split, cfg.limit)
    else:
        assert cfg.data_path is not None
        rows = load_rows(Path(cfg.data_path), cfg.limit)
    runner = AgentRunner(
        cfg.gateway_url,
        program,
        reward=reward,
        task=task,
        samples_per_row=cfg.samples_per_row or group_size,
        concurrency=cfg.concurrency,
        timeout_s=cfg.timeout_s,
        run_id=run_id,
        token=token.get_secret_value() if token else None,
    )
    try:
        return await runner.run(rows)
    finally:
        await runner.aclose()
