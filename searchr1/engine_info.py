"""What a client of the engines asks first: the served model's info (waited for, with a
deadline) and its limits. Shared by every service that calls the engines (the orchestrator,
the gateway); duck-typed over any client with `async get_model_info()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

# A try's bound: a frozen engine (SIGSTOP, a stuck CUDA call) accepts connections and never
# answers, so an unbounded first call hung silently for the client's whole timeout (600 s).
ENGINE_ANSWER_S = 10.0


class ModelInfoSource(Protocol):
    async def get_model_info(self) -> dict[str, Any]: ...


async def wait_for_engine(engine: ModelInfoSource, timeout_s: float) -> dict[str, Any]:
    """The engine's model info, waiting while it starts, restarts or is frozen, for at most
    `timeout_s`: logged once when the wait starts and once when it ends."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout_s
    warned = False
    while True:
        try:
            left = max(deadline - loop.time(), 0.001)
            info = dict(await asyncio.wait_for(engine.get_model_info(), min(ENGINE_ANSWER_S, left)))
        except Exception as e:
            if loop.time() >= deadline:
                raise RuntimeError(f"engine not reachable after {timeout_s}s: {e!r}") from e
            if not warned:
                log.warning("waiting for the engine", extra={"error": repr(e)})
                warned = True
            await asyncio.sleep(min(1.0, max(deadline - loop.time(), 0.0)))
            continue
        if warned:
            log.warning("engine answered", extra={"waited_s": round(loop.time() - start, 1)})
        return info


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
