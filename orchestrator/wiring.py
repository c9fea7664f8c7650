"""Orchestrator wiring: clients from config, a Rollout over the live engine, the Orchestrator,
and the two ways to run them: `serve` (the service: the HTTP app of `server.py` beside
`Orchestrator.run`) and `evaluate_served` (`searchr1 eval`, the demo: `evaluate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_client.client import InferenceClient
from engine_client.pool import EnginePool
from orchestrator.config import OrchestratorConfig, TaskConfig
from orchestrator.data import PromptSampler, load_prompts, validation_subset
from orchestrator.evaluate import evaluate
from orchestrator.formats.environment import EnvTurns
from orchestrator.loop import Orchestrator
from orchestrator.markers import RunIdInUse
from orchestrator.rollout import Rollout
from orchestrator.rollout_log import RolloutLog
from orchestrator.sample import Prompt
from orchestrator.scoring import Scorer
from orchestrator.server import LoopState, create_app
from orchestrator.tasks.base import Task, steps_episodes
from orchestrator.tasks.registry import load_task, task_rows
from orchestrator.tokenizer import rust_tokenizer
from orchestrator.tools.registry import build_toolbox
from orchestrator.tools.search import SearchTool
from orchestrator.tools.toolbox import Toolbox
from retriever.client import RetrieverClient
from searchr1.bus import TrajectoryBus
from searchr1.engine_info import model_limits, wait_for_engine
from searchr1.sections import BusConfig, EnginesConfig, RunConfig
from searchr1.service import uvicorn_server
from searchr1.weightsync.registry import EngineRegistry, discovered, registry_key

log = logging.getLogger(__name__)


@dataclass
class Clients:
    engine: InferenceClient | EnginePool
    retriever: RetrieverClient
    bus: TrajectoryBus
    tools: Toolbox | None = None  # built by connect_rollout (MCP servers' connections)
    registry: EngineRegistry | None = None  # engines.discover: where joined engines announce

    async def aclose(self) -> None:
        if self.tools is not None:
            await self.tools.aclose()
        if self.registry is not None:
            with contextlib.suppress(Exception):
                await self.registry.aclose()
        for c in (self.engine, self.retriever):
            with contextlib.suppress(Exception):
                await c.aclose()
        with contextlib.suppress(Exception):
            await self.bus.close()


def make_clients(
    cfg: OrchestratorConfig, engines: EnginesConfig, redis_url: str, bus_cfg: BusConfig
) -> Clients:
    # One connection per sample waiting on the engine (+ the weight polls) and per search in
    # flight, on aiohttp pools called directly (searchr1.json_http): httpcore's pool scans every
    # connection on every request (15 ms of CPU per request at 512 connections), and httpx's
    # request/response objects over aiohttp cost more than the I/O (bench/orchestrator_scale.py).
    def engine_client(url: str) -> InferenceClient:
        return InferenceClient(
            url,
            deadline_s=cfg.engine_retry_s,
            max_connections=cfg.rollout.max_concurrent_samples + 8,
            http_backend="aiohttp",
        )

    # Through the router when there is one; one engine directly; several over our own pool.
    engine: InferenceClient | EnginePool
    registry: EngineRegistry | None = None
    if engines.router_url or (len(engines.urls) == 1 and not engines.discover):
        engine = engine_client(engines.router_url or engines.urls[0])
    else:
        # engines.discover: the engines added during the run (announced in the registry) too.
        registry = (
            EngineRegistry.from_url(redis_url, registry_key(bus_cfg.stream))
            if engines.discover
            else None
        )
        engine = EnginePool(
            engines.urls,
            engine_client,
            spill_at_in_flight=engines.spill_at_in_flight,
            probe_s=engines.probe_s,
            probe_timeout_s=engines.probe_timeout_s,
            probe_misses=engines.probe_misses,
            discover=(lambda: discovered(registry, engines.urls)) if registry else None,
        )
    return Clients(
        engine=engine,
        retriever=RetrieverClient(
            cfg.search.retriever_url,
            timeout_s=cfg.search.limits.timeout_s,
            max_connections=cfg.search.limits.max_concurrency,
            http_backend="aiohttp",
        ),
        bus=TrajectoryBus.from_url(redis_url, bus_cfg),
        registry=registry,
    )


def load_tokenizer(path: str) -> Any:
    """The model's tokenizer; encode/decode on its Rust backend (`orchestrator.tokenizer`)."""
    from transformers import AutoTokenizer

    return rust_tokenizer(AutoTokenizer.from_pretrained(path))


def configured_task(cfg: OrchestratorConfig) -> Task | None:
    """`orchestrator.task`, built (None: Search-R1 over `data` and `rollout.tools`)."""
    return load_task(cfg.task) if cfg.task is not None else None


def training_prompts(cfg: OrchestratorConfig, task: Task | None) -> list[Prompt]:
    """The train rows: the task's, else `data.train_path`'s (capped by `data.max_prompts`)."""
    if task is not None:
        return task_rows(task, "train", cfg.data.max_prompts)
    if not cfg.data.train_path:
        raise ValueError("orchestrator.data.train_path is not set (nor orchestrator.task)")
    return load_prompts(cfg.data.train_path, cfg.data.max_prompts)


def validation_prompts(cfg: OrchestratorConfig, task: Task | None) -> list[Prompt]:
    """The fixed held-out subset: the task's eval rows, else `data.val_path`'s (or none)."""
    if task is not None:
        rows = task_rows(task, "eval")
    else:
        rows = load_prompts(cfg.data.val_path) if cfg.data.val_path else []
    return validation_subset(rows, cfg.data.val_size, cfg.data.seed) if rows else []


def rollout_settings(cfg: OrchestratorConfig, task: Task | None) -> OrchestratorConfig:
    """`cfg` with a tool task's action format and tools in `rollout` (the task's win)."""
    if task is None or task.loop_tools is None:
        return cfg
    rollout = cfg.rollout.model_copy(
        update={"action_format": task.loop_tools.action_format, "tools": task.loop_tools.tools}
    )
    return cfg.model_copy(update={"rollout": rollout})


def uses_retriever(cfg: OrchestratorConfig, task: Task | None) -> bool:
    """Whether the rollouts search (so the retriever must be up)."""
    if steps_episodes(task):
        return False
    return any(t.name == "search" for t in rollout_settings(cfg, task).rollout.tools)


async def connect_rollout(
    cfg: OrchestratorConfig,
    clients: Clients,
    *,
    greedy: bool = False,
    task: Task | None = None,
) -> tuple[Rollout, dict[str, Any]]:
    """A Rollout over the live engine (waited for) and its tokenizer; also the engine's info.
    `task`: the environment its samples step (None: the tools of `rollout.tools`)."""
    info = await wait_for_engine(clients.engine, cfg.engine_retry_s)
    tokenizer = load_tokenizer(cfg.tokenizer_path or str(info["model_path"]))
    vocab_size, context_length = model_limits(
        info, cfg.tokenizer_path or str(info["model_path"]), tokenizer
    )
    # Token ids the model cannot embed never reach the engine (one crashes a whole SGLang).
    clients.engine.vocab_size = vocab_size
    cfg = rollout_settings(cfg, task)
    env = None
    if steps_episodes(task):  # the task's environment, no tools
        env = EnvTurns(
            task,
            tokenizer,
            (cfg.task or TaskConfig(name=task.name)).limits,
            observation_max_tokens=cfg.rollout.observation_max_tokens,
        )
        clients.tools = clients.tools or Toolbox([])
    elif clients.tools is None:  # rollout.tools, built once: MCP servers asked for their tools
        search = SearchTool(clients.retriever, cfg.search)
        clients.tools = await build_toolbox(cfg.rollout.tools, search)
    rollout = Rollout(
        cfg.rollout,
        clients.engine,
        clients.tools,
        tokenizer,
        engine_retry_s=cfg.engine_retry_s,
        greedy=greedy,
        context_length=context_length,
        env=env,
    )
    return rollout, info


async def build_orchestrator(
    cfg: OrchestratorConfig, run: RunConfig, clients: Clients, task: Task | None = None
) -> Orchestrator:
    """Validate everything that can fail at start-up (hooks, task, data) before any rollout.
    `task`: `orchestrator.task` as built already (else built here)."""
    task = task or configured_task(cfg)
    scorer = Scorer(cfg.reward, scored_by_task=steps_episodes(task))
    prompts = training_prompts(cfg, task)
    sampler = PromptSampler(
        prompts,
        run.groups_per_step + cfg.rollout.over_sampling,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
        epochs=cfg.epochs,
    )
    rollout, _ = await connect_rollout(cfg, clients, task=task)
    validation = None
    val = validation_prompts(cfg, task) if cfg.eval_every_steps else []
    if val:
        greedy = Rollout(
            rollout.cfg,
            clients.engine,
            rollout.tools,
            rollout.tokenizer,
            engine_retry_s=cfg.engine_retry_s,
            greedy=True,
            context_length=rollout.context_length,
            env=rollout.env,
        )
        validation = (greedy, val)
    return Orchestrator(
        cfg,
        run=run,
        validation=validation,
        rollout_log=RolloutLog(cfg.rollout_log, rollout.tokenizer)
        if cfg.rollout_log.run_dir
        else None,
        rollout=rollout,
        scorer=scorer,
        engine=clients.engine,
        bus=clients.bus,
        sampler=sampler,
    )


async def serve(
    cfg: OrchestratorConfig,
    engines: EnginesConfig,
    run: RunConfig,
    redis_url: str,
    bus_cfg: BusConfig,
    *,
    fresh: bool = False,
) -> int:
    """The service: `Orchestrator.run` with the HTTP endpoints beside it (up while the loop is
    built: /ready says why it is not running yet); exit status 0 when all steps are done."""
    task = configured_task(cfg)
    clients = make_clients(cfg, engines, redis_url, bus_cfg)
    state = LoopState()
    ui = cfg.rollout_log.run_dir if cfg.ui else None
    app = create_app(
        clients.engine,
        clients.retriever,
        clients.bus,
        state,
        ui_run_dir=ui,
        uses_retriever=uses_retriever(cfg, task),
    )
    server = uvicorn_server(app, cfg.http)

    async def loop() -> None:
        try:
            orch = await build_orchestrator(cfg, run, clients, task)
            state.orchestrator = orch
            await orch.run(fresh=fresh)
            state.done = True
        except RunIdInUse as e:  # a usage error: the message says what to do
            state.error = str(e)
            log.error(str(e))
        except Exception as e:
            state.error = f"{type(e).__name__}: {e}"
            log.exception("rollout loop failed")
        finally:
            server.should_exit = True

    try:
        running = asyncio.create_task(loop())
        await server.serve()
        if not running.done():  # SIGTERM: stop rolling out; unpublished groups are redone later
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
    finally:
        await clients.aclose()
    return 1 if state.error else 0


async def evaluate_served(
    orch: OrchestratorConfig,
    engines: EnginesConfig,
    bus: BusConfig,
    prompts: list[Prompt],
    *,
    run_id: str,
    redis_url: str | None = None,
    concurrency: int = 64,
) -> dict[str, Any]:
    """`evaluate` against the engines and the retriever (what `searchr1 eval` runs).

    Adds the engine's `weight_version` and `model_path` to the result.
    """
    # Eval needs no bus; a dummy URL keeps make_clients simple (never connected).
    clients = make_clients(orch, engines, redis_url or "redis://127.0.0.1:1/0", bus)
    try:
        rollout, info = await connect_rollout(
            orch, clients, greedy=True, task=configured_task(orch)
        )
        log_ = RolloutLog(orch.rollout_log, rollout.tokenizer) if orch.rollout_log.run_dir else None
        label = f"{Path(str(info.get('model_path', ''))).name} v{info.get('weight_version')}"
        result = await evaluate(
            orch,
            rollout,
            prompts,
            run_id=run_id,
            concurrency=concurrency,
            rollout_log=log_,
            label=label,
        )
        result["weight_version"] = info.get("weight_version")
        result["model_path"] = info.get("model_path")
        return result
    finally:
        await clients.aclose()
