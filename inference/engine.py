"""The reference engine: a Hugging Face causal LM served with continuous batching.

`TorchEngine` loads the model and puts its parts together; each part reads (and is tested) on
its own, none needs the HTTP server (`inference.server`, a thin layer over this class):
- `inference.scheduler`: the thread that owns the model, its queue and running batch, and the
  commands that run between decode steps;
- `inference.weight_updates`: weight updates from disk, by broadcast and by hand-over;
- `inference.pause`: pausing generation for an update, held by a lease;
- `inference.memory`: releasing and resuming memory for a trainer on the same device.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from inference.config import TorchEngineConfig
from inference.memory import MemoryState
from inference.pause import PauseLease, check_mode
from inference.prefix_cache import PrefixCache
from inference.prompts import check_prompt, check_prompt_text, eos_token_ids
from inference.requests import GenerateOutput, Request
from inference.sampling import SamplingParams, make_generator
from inference.scheduler import GEN_REQUESTS, REJECTED, Scheduler
from inference.weight_updates import WeightUpdates
from searchr1.weightsync.delta import state_checksum
from searchr1.weightsync.handover import Handover
from searchr1.weightsync.protocol import Bucket, GroupJoin
from searchr1.weightsync.receiver import WeightLoader

log = logging.getLogger(__name__)


class TorchEngine:
    """Continuous-batching generation over a local Hugging Face causal LM."""

    def __init__(self, model_path: str | Path, cfg: TorchEngineConfig | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg or TorchEngineConfig()
        self.device = torch.device(self.cfg.device)
        self.dtype = getattr(torch, self.cfg.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=self.dtype)
        self.model.to(self.device).eval()
        mcfg = self.model.config
        self.vocab_size = int(mcfg.vocab_size)
        self.context_length = int(
            self.cfg.context_length or getattr(mcfg, "max_position_embeddings", 4096)
        )
        # `text` prompts are tokenized here, never on the event loop (a long one takes seconds);
        # one thread, so tokenizing cannot take more than one core from the scheduler.
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="engine-tokenizer")
        self.weights = WeightLoader(self.model, timeout_s=self.cfg.weight_group_timeout_s)
        self.memory = MemoryState(
            self.model,
            self.device,
            cpu_backup=self.cfg.weights_cpu_backup,
            flush_kv=lambda: self.scheduler.flush_kv(),
        )
        self.pause_lease = PauseLease(
            self.cfg.pause_lease_s, on_expire=lambda: self.updates.drop_session()
        )
        self.scheduler = Scheduler(
            self.model,
            self.tokenizer,
            self.cfg,
            eos_ids=eos_token_ids(self.model, self.tokenizer),
            context_length=self.context_length,
            memory=self.memory,
            pause=self.pause_lease,
        )
        self.updates = WeightUpdates(
            self.weights, self.scheduler, self.memory, self.pause_lease, str(model_path)
        )
        self.scheduler.start()

    @property
    def model_path(self) -> str:
        return self.updates.model_path

    @property
    def weight_version(self) -> int:
        return self.scheduler.weight_version

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.scheduler.prefix_cache

    @property
    def pause_leases_expired(self) -> int:
        return self.pause_lease.expired

    # ---- generation --------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        text: str | None = None,
        rid: str | None = None,
    ) -> GenerateOutput:
        """Generate for one prompt. ValueError: bad input; EngineOverloaded: queue full."""
        params = params or SamplingParams()
        try:
            params.validate()
            ids = await self._prompt_ids(input_ids, text)
            check_prompt(
                ids, params, context_length=self.context_length, vocab_size=self.vocab_size
            )
        except ValueError as e:
            REJECTED.labels("bad_request").inc()
            log.info("generate rejected", extra={"reason": str(e)})
            raise
        if params.max_new_tokens == 0:  # SGLang answers an empty output, not an error
            GEN_REQUESTS.labels("length").inc()
            return GenerateOutput(
                text="",
                output_ids=[],
                logprobs=[],
                finish_reason={"type": "length", "length": 0},
                prompt_tokens=len(ids),
                weight_version=self.weight_version,
            )
        loop = asyncio.get_running_loop()
        req = Request(
            rid=rid or uuid.uuid4().hex,
            input_ids=ids,
            params=params,
            loop=loop,
            future=loop.create_future(),
            generator=make_generator(params.seed),
        )
        self.scheduler.submit(req)
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.cancelled = True  # the client went away: free the slot at the next step
            raise

    async def _prompt_ids(self, input_ids: list[int] | None, text: str | None) -> list[int]:
        if input_ids is not None and text is not None:
            raise ValueError("give either input_ids or text, not both")
        if input_ids is None:
            if text is None:
                raise ValueError("input_ids (or text) is required")
            check_prompt_text(text, self.context_length)
            pool, encode = self._tokenizer_pool, self.tokenizer.encode
            input_ids = await asyncio.get_running_loop().run_in_executor(pool, encode, text)
        return [int(t) for t in input_ids]

    async def run_command(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the scheduler thread between decode steps (even while paused)."""
        return await self.scheduler.run_command(fn)

    async def abort_all(self, message: str = "aborted") -> None:
        """Finish every running and waiting request with finish_reason abort (no pause)."""
        await self.run_command(lambda: self.scheduler.abort_all(message))

    async def flush_cache(self) -> None:
        await self.run_command(self.scheduler.flush_prefix_cache)

    # ---- pause -------------------------------------------------------------------------------

    async def pause(self, mode: str = "abort") -> None:
        check_mode(mode)

        def do() -> None:
            self.pause_lease.hold()
            if mode == "abort":
                self.scheduler.abort_all("aborted by pause_generation")
            elif mode == "retract":
                self.scheduler.retract_all()

        await self.run_command(do)

    async def resume(self) -> None:
        await self.run_command(self.pause_lease.release)

    async def renew_pause(self) -> None:
        """The trainer is alive: keep a pause for another `pause_lease_s`."""
        await self.run_command(self.pause_lease.renew)

    # ---- weight updates (`inference.weight_updates`) ------------------------------------------

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> int:
        return await self.updates.from_disk(model_path, version)

    async def begin_weight_update(self) -> None:
        await self.updates.begin()

    async def end_weight_update(self) -> int:
        return await self.updates.end()

    async def init_weights_update_group(self, join: GroupJoin) -> None:
        await self.updates.init_group(join)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self.updates.destroy_group(group_name)

    async def update_weights_from_distributed(
        self, bucket: Bucket, version: int | None = None
    ) -> int:
        return await self.updates.from_distributed(bucket, version)

    async def update_weights_from_tensor(
        self, handover: Handover, version: int | None = None, *, flush_cache: bool = True
    ) -> int:
        return await self.updates.from_tensor(handover, version, flush_cache=flush_cache)

    # ---- memory (`inference.memory`) ---------------------------------------------------------

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """SGLang's release_memory_occupation; ValueError: refused."""

        def do() -> None:
            self.memory.release(
                tags,
                running=len(self.scheduler.running),
                waiting=self.scheduler.waiting_count(),
                paused=self.pause_lease.paused,
                session_open=self.weights.session is not None,
            )

        await self.run_command(do)

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self.run_command(lambda: self.memory.resume(tags))

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": str(self.weight_version),
            "model_type": getattr(self.model.config, "model_type", None),
            "architectures": getattr(self.model.config, "architectures", None),
            # Ours (SGLang reports these in /get_server_info): what a weight sender needs.
            "dtype": self.cfg.dtype,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "engine": "torch",
        }

    def weights_checksum(self) -> dict[str, Any]:
        """Scheduler thread: the served weights' checksum (`delta.state_checksum` over the
        state dict: tied weights under each name) and version."""
        named = self.model.state_dict()
        return {
            "weight_version": str(self.weight_version),
            "checksum": state_checksum(named.items()),
            "tensors": len(named),
        }

    def shutdown(self) -> None:
        self.scheduler.stop()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.weights.close()
