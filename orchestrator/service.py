"""The orchestrator process: the rollout loop plus /health, /ready, /metrics, /status.

`build_orchestrator` wires the clients (engine, retriever, bus) and the loop from the config;
`serve` runs the loop and the HTTP endpoints together and returns when the loop is done (or
on SIGTERM). Readiness is real: the engine answers, the retriever answers, Redis answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from orchestrator.config import OrchestratorConfig
from orchestrator.data import PromptSampler, load_prompts, validation_subset
from orchestrator.loop import Orchestrator
from orchestrator.rollout import Rollout
from orchestrator.scoring import Scorer
from orchestrator.search import SearchTool
from searchr1.sections import BusConfig
from searchr1.service import create_service_app, uvicorn_server

log = logging.getLogger(__name__)


@dataclass
class Clients:
    engine: Any  # inference.client.InferenceClient
    retriever: Any  # retriever.client.RetrieverClient
    bus: Any  # searchr1.bus.TrajectoryBus

    async def aclose(self) -> None:
        for c in (self.engine, self.retriever):
            with contextlib.suppress(Exception):
                await c.aclose()
        with contextlib.suppress(Exception):
            await self.bus.close()


def make_clients(cfg: OrchestratorConfig, redis_url: str, bus_cfg: BusConfig) -> Clients:
    from inference.client import InferenceClient
    from retriever.client import RetrieverClient
    from searchr1.bus import TrajectoryBus

    return Clients(
        engine=InferenceClient(cfg.engine_url),
        retriever=RetrieverClient(cfg.search.retriever_url, timeout_s=cfg.search.timeout_s),
        bus=TrajectoryBus.from_url(redis_url, bus_cfg),
    )


async def wait_for_engine(engine: Any, timeout_s: float) -> dict[str, Any]:
    """The engine's model info, waiting (with a log line, once) while it starts."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    warned = False
    while True:
        try:
            return dict(await engine.get_model_info())
        except Exception as e:
            if loop.time() > deadline:
                raise RuntimeError(f"engine not reachable after {timeout_s}s: {e}") from e
            if not warned:
                log.warning("waiting for the engine", extra={"error": repr(e)})
                warned = True
            await asyncio.sleep(1.0)


def model_limits(info: dict[str, Any], model_dir: str, tokenizer: Any) -> tuple[int, int | None]:
    """(rows of the embedding, context length) of the served model: the engine's word (ours
    reports both), else the model directory's config.json (SGLang reports neither), else the
    tokenizer's size and no context limit."""
    config: dict[str, Any] = {}
    path = Path(model_dir) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        config = config.get("text_config", config)  # multimodal configs nest the LM's
    vocab = info.get("vocab_size") or config.get("vocab_size") or len(tokenizer)
    context = info.get("context_length") or config.get("max_position_embeddings")
    return int(vocab), int(context) if context else None


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def connect_rollout(
    cfg: OrchestratorConfig, clients: Clients, *, greedy: bool = False
) -> tuple[Rollout, dict[str, Any]]:
    """A Rollout over the live engine (waited for) and its tokenizer; also the engine's info."""
    info = await wait_for_engine(clients.engine, cfg.engine_retry_s)
    tokenizer = load_tokenizer(cfg.tokenizer_path or str(info["model_path"]))
    vocab_size, context_length = model_limits(
        info, cfg.tokenizer_path or str(info["model_path"]), tokenizer
    )
    # Token ids the model cannot embed never reach the engine (one crashes a whole SGLang).
    clients.engine.vocab_size = vocab_size
    rollout = Rollout(
        cfg.rollout,
        clients.engine,
        SearchTool(clients.retriever, cfg.search),
        tokenizer,
        engine_retry_s=cfg.engine_retry_s,
        greedy=greedy,
        context_length=context_length,
    )
    return rollout, info


async def build_orchestrator(cfg: OrchestratorConfig, clients: Clients) -> Orchestrator:
    """Validate everything that can fail at start-up (hooks, data) before any rollout."""
    scorer = Scorer(cfg.reward)
    if not cfg.data.train_path:
        raise ValueError("orchestrator.data.train_path is not set")
    prompts = load_prompts(cfg.data.train_path, cfg.data.max_prompts)
    sampler = PromptSampler(
        prompts,
        cfg.rollout.prompts_per_step,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
        epochs=cfg.epochs,
    )
    rollout, _ = await connect_rollout(cfg, clients)
    validation = None
    if cfg.eval_every_steps and cfg.data.val_path:
        val = validation_subset(load_prompts(cfg.data.val_path), cfg.data.val_size, cfg.data.seed)
        greedy = Rollout(
            cfg.rollout,
            clients.engine,
            rollout.search_tool,
            rollout.tokenizer,
            engine_retry_s=cfg.engine_retry_s,
            greedy=True,
        )
        validation = (greedy, val)
    return Orchestrator(
        cfg,
        validation=validation,
        rollout=rollout,
        scorer=scorer,
        engine=clients.engine,
        bus=clients.bus,
        sampler=sampler,
    )


def create_app(clients: Clients, state: dict[str, Any]) -> FastAPI:
    async def engine_ready() -> str:
        info = await clients.engine.get_model_info()
        return f"weight_version {info['weight_version']}"

    async def retriever_ready() -> str:
        if not await clients.retriever.health():
            raise RuntimeError("retriever /health failed")
        return "ok"

    async def redis_ready() -> str:
        return str(await clients.bus.ping())

    async def loop_ready() -> str:
        if state.get("error"):
            raise RuntimeError(state["error"])
        return "running" if state.get("orchestrator") else "starting"

    app = create_service_app(
        "orchestrator",
        ready_checks={
            "engine": engine_ready,
            "retriever": retriever_ready,
            "redis": redis_ready,
            "loop": loop_ready,
        },
    )

    @app.get("/status")
    async def status() -> dict[str, Any]:
        orch: Orchestrator | None = state.get("orchestrator")
        return {
            "step": orch.step if orch else None,
            "base_version": orch.base_version if orch else None,
            "engine_version": orch.current_version if orch else None,
            "running": bool(orch and orch.running),
            "done": state.get("done", False),
            "error": state.get("error"),
            "last_step": orch.last_summary if orch else {},
            "last_eval": orch.last_eval if orch else {},
        }

    return app


async def serve(cfg: OrchestratorConfig, redis_url: str, bus_cfg: BusConfig) -> int:
    """Run the loop with its HTTP endpoints; exit status 0 when all steps are done."""
    clients = make_clients(cfg, redis_url, bus_cfg)
    state: dict[str, Any] = {}
    server = uvicorn_server(create_app(clients, state), cfg.http)

    async def loop() -> None:
        try:
            orch = await build_orchestrator(cfg, clients)
            state["orchestrator"] = orch
            await orch.run()
            state["done"] = True
        except Exception as e:
            state["error"] = f"{type(e).__name__}: {e}"
            log.exception("rollout loop failed")
        finally:
            server.should_exit = True

    try:
        task = asyncio.create_task(loop())
        await server.serve()
        if not task.done():  # SIGTERM: stop rolling out; unpublished groups are redone later
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        await clients.aclose()
    return 1 if state.get("error") else 0
