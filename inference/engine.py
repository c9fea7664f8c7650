"""The reference engine: a Hugging Face causal LM served with continuous batching.

One scheduler thread owns the model. Each iteration it
1. runs queued control commands (weight updates, flush) - so updates land between decode steps;
2. admits waiting requests: those arriving together are prefilled together (left-padded),
   each on top of its longest cached prefix when the prefix cache is on (`prefix_cache.py`;
   `admission.py` chooses each pass and keeps the cache's entries of it);
3. samples one token for every running request from its last logits and retires finished ones;
4. runs ONE batched decode step over the remaining requests.
The running batch (`inference.batch.RunningBatch`) keeps a left-padded KV cache that grows by
one column per step; requests join and leave between steps without waiting for the rest of
the batch, and a request's tokens do not depend on its neighbours beyond floating-point noise.

The HTTP server (`inference.server`) is a thin layer over `TorchEngine`; everything here is usable
without HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from prometheus_client import Counter, Gauge, Histogram

from inference import admission
from inference.batch import RunningBatch, prefill
from inference.config import TorchEngineConfig
from inference.memory import MemoryState
from inference.prefix_cache import PrefixCache
from inference.prompts import check_prompt, check_prompt_text, eos_token_ids
from inference.requests import CommandResult, GenerateOutput, Request
from inference.sampling import SamplingParams, make_generator, sample_batch
from inference.stopping import final_output, finish_reason
from inference.tensor_update import TensorUpdates
from searchr1.weightsync.handover import Handover
from searchr1.weightsync.protocol import Bucket, GroupJoin
from searchr1.weightsync.receiver import WeightLoader

log = logging.getLogger(__name__)

GEN_REQUESTS = Counter(
    "searchr1_inference_requests_total", "Finished generate requests", ["finish_reason"]
)
GEN_TOKENS = Counter("searchr1_inference_output_tokens_total", "Generated tokens")
RUNNING = Gauge("searchr1_inference_running_requests", "Requests in the decode batch")
WAITING = Gauge("searchr1_inference_waiting_requests", "Requests waiting for admission")
STEP_SECONDS = Histogram(
    "searchr1_inference_decode_step_seconds",
    "One batched decode step",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
REJECTED = Counter("searchr1_inference_rejected_total", "Rejected generate requests", ["reason"])
PAUSE_EXPIRED = Counter(
    "searchr1_inference_pause_leases_expired_total",
    "Pauses that ran out without a continue_generation (the trainer vanished mid-push)",
)

PREFILL_TOKENS = Counter(
    "searchr1_inference_prefill_tokens_total",
    "Prompt (and re-admitted) tokens at admission: computed by a prefill, or served from the "
    "prefix cache",
    ["source"],
)
PREFIX_CACHE_TOKENS = Gauge(
    "searchr1_inference_prefix_cache_tokens", "Tokens held in the prefix cache"
)

PAUSE_MODES = ("abort", "in_place", "retract")


class EngineOverloaded(Exception):
    """The waiting queue is full (HTTP 429)."""


class EngineStopped(Exception):
    """The engine is shutting down."""


class TorchEngine:
    """Continuous-batching generation over a local Hugging Face causal LM."""

    def __init__(self, model_path: str | Path, cfg: TorchEngineConfig | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg or TorchEngineConfig()
        self.model_path = str(model_path)
        self.device = torch.device(self.cfg.device)
        self.dtype = getattr(torch, self.cfg.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        self.model.to(self.device).eval()
        mcfg = self.model.config
        self.vocab_size = int(mcfg.vocab_size)
        self.context_length = int(
            self.cfg.context_length or getattr(mcfg, "max_position_embeddings", 4096)
        )
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        # `text` prompts are tokenized here, never on the event loop (a long one takes seconds);
        # one thread, so tokenizing cannot take more than one core from the scheduler.
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="engine-tokenizer")
        self.weights = WeightLoader(self.model, timeout_s=self.cfg.weight_group_timeout_s)
        self.weight_version = 0
        self._session_version: int | None = None  # carried by the open update session
        # Used by the scheduler thread only (commands included), so it needs no lock.
        budget = self.cfg.prefix_cache_tokens
        self.prefix_cache = PrefixCache(budget) if budget else None
        self.memory = MemoryState(
            self.model,
            self.device,
            cpu_backup=self.cfg.weights_cpu_backup,
            flush_kv=lambda: (self._flush_prefix_cache(), self._batch.clear()),
        )
        self.tensor_updates = TensorUpdates(self.weights, self.memory)

        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._commands: deque[tuple[Callable[[], Any], CommandResult]] = deque()
        self._batch = RunningBatch(self.device)
        self._paused = False
        self._pause_deadline = 0.0  # monotonic; renewed by every weight-update call
        self.pause_leases_expired = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    # ---- public API (async, called from the event loop) ------------------------------------

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
        with self._cond:
            if self._stopping:
                raise EngineStopped("engine is shutting down")
            self.memory.refuse_generation()  # MemoryReleased: a 503
            if len(self._waiting) >= self.cfg.max_queued_requests:
                REJECTED.labels("overloaded").inc()
                raise EngineOverloaded(
                    f"{len(self._waiting)} requests waiting (max_queued_requests)"
                )
            self._waiting.append(req)
            WAITING.set(len(self._waiting))
            self._cond.notify_all()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.cancelled = True  # the client went away: free the slot at the next step
            raise

    async def run_command(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the scheduler thread between decode steps (even while paused)."""
        result = CommandResult(asyncio.get_running_loop())
        with self._cond:
            self._commands.append((fn, result))
            self._cond.notify_all()
        return await result.future

    async def pause(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)} (got {mode!r})")

        def do() -> None:
            self._paused = True
            self._renew_pause()
            if mode == "abort":
                self._abort_all("aborted by pause_generation")
            elif mode == "retract":
                self._retract_all()

        await self.run_command(do)

    async def abort_all(self, message: str = "aborted") -> None:
        """Finish every running and waiting request with finish_reason abort (no pause)."""
        await self.run_command(lambda: self._abort_all(message))

    async def resume(self) -> None:
        def do() -> None:
            self._paused = False

        await self.run_command(do)

    async def renew_pause(self) -> None:
        """The trainer is alive: keep a pause for another `pause_lease_s`."""
        await self.run_command(self._renew_pause)

    def _renew_pause(self) -> None:
        self._pause_deadline = time.monotonic() + self.cfg.pause_lease_s

    def _expire_pause(self) -> None:
        """Scheduler thread: the pause ran out without a continue; resume and drop the push."""
        self._paused = False
        self.pause_leases_expired += 1
        PAUSE_EXPIRED.inc()
        dropped = self.weights.session is not None
        self.weights.session = None
        self._session_version = None
        log.warning(
            "pause lease expired: resuming generation (the trainer vanished mid-push?)",
            extra={"pause_lease_s": self.cfg.pause_lease_s, "dropped_open_push": dropped},
        )

    async def flush_cache(self) -> None:
        await self.run_command(self._flush_prefix_cache)

    def _flush_prefix_cache(self) -> None:
        """Scheduler thread: drop the prefix cache, as SGLang does on every weight update.
        Running requests keep their K/V but, being of the old generation, do not insert it."""
        if self.prefix_cache is not None:
            self.prefix_cache.flush()
            PREFIX_CACHE_TOKENS.set(0)

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> int:
        """Load a checkpoint; the served version becomes `version` (unchanged when None, as
        in SGLang). Returns the version."""

        def do() -> int:
            self.memory.require_weights("update_weights_from_disk")
            try:
                self.weights.load_from_disk(Path(model_path))
            finally:  # even a failed load may have changed some weights: nothing cached stays
                self._flush_prefix_cache()
            self.memory.weights_loaded()
            self.model_path = str(model_path)
            return self._set_version(version)

        return await self.run_command(do)

    async def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang's protocol around distributed updates)."""

        def do() -> None:
            self._renew_pause()
            self.memory.require_weights("begin_weight_update")
            self.weights.begin_session()

        await self.run_command(do)

    async def end_weight_update(self) -> int:
        """Close the session: every bucket received in it becomes the served weights at once
        (none if one was rejected), with the last version an update of the session carried."""

        def do() -> int:
            self._renew_pause()
            version, self._session_version = self._session_version, None
            try:
                self.weights.end_session()
            finally:
                self._flush_prefix_cache()
            self.memory.weights_loaded()
            return self._set_version(version)

        return await self.run_command(do)

    async def init_weights_update_group(self, join: GroupJoin) -> None:
        # Joining blocks until every rank arrives: not on the scheduler thread.
        await asyncio.to_thread(self.weights.init_group, join)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await asyncio.to_thread(self.weights.destroy_group, group_name)

    async def update_weights_from_distributed(
        self, bucket: Bucket, version: int | None = None
    ) -> int:
        """Receive one bucket into the open session; applied by `end_weight_update`.

        Received on a worker thread, not the scheduler's: it only stages tensors, and a sender
        that dies mid-broadcast blocks it until the group's timeout, which must not stall
        generation (the pause lease resumes it meanwhile)."""
        await self.renew_pause()
        session = self.weights.session
        await asyncio.to_thread(self.weights.receive, bucket)

        def done() -> int:
            self._renew_pause()
            # Not if the lease ran out meanwhile: that push was dropped with its session.
            if version is not None and self.weights.session is session:
                self._session_version = version
            return self.weight_version

        return await self.run_command(done)

    async def update_weights_from_tensor(
        self, handover: Handover, version: int | None = None, *, flush_cache: bool = True
    ) -> int:
        """Copy one handed-over bucket into the weights (inside the open session; see
        `inference.tensor_update`); `version` is served from the session's end."""

        def do() -> int:
            self._renew_pause()
            try:
                self.tensor_updates.apply(handover)
            finally:  # even a refused bucket may follow applied ones: nothing cached stays
                if flush_cache:
                    self._flush_prefix_cache()
            if version is not None:
                self._session_version = version
            return self.weight_version

        return await self.run_command(do)

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """SGLang's release_memory_occupation (`inference.memory`); ValueError: refused."""

        def do() -> None:
            with self._cond:
                waiting = len(self._waiting)
            self.memory.release(
                tags,
                running=len(self._running),
                waiting=waiting,
                paused=self._paused,
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

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.weights.close()

    @property
    def _held(self) -> bool:
        """No decode step runs: paused, or memory released (retracted requests wait)."""
        return self._paused or not self.memory.serving

    @property
    def _running(self) -> list[Request]:
        return self._batch.rows

    # ---- validation ------------------------------------------------------------------------

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

    def _set_version(self, version: int | None) -> int:
        if version is not None and version != self.weight_version:
            # Like SGLang: requests in flight record where their weights changed, so their
            # answer lists the versions that produced each span of their output.
            with self._cond:
                live = [*self._running, *self._waiting]
            for req in live:
                if req.output_ids:
                    req.version_events.append((self.weight_version, len(req.output_ids)))
            self.weight_version = version
        return self.weight_version

    # ---- the scheduler thread --------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while (
                    not self._stopping
                    and not self._commands
                    and (self._held or (not self._waiting and not self._running))
                ):
                    if self._paused:
                        left = self._pause_deadline - time.monotonic()
                        if left <= 0:
                            self._expire_pause()
                            continue
                        self._cond.wait(timeout=left)
                    else:
                        self._cond.wait()
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, result in commands:
                result.run(fn)
            if self._held:
                continue
            try:
                self._step()
            except Exception as e:  # a bug must not kill the thread silently: fail the batch
                log.exception("engine step failed")
                for req in self._running:
                    req.resolve(RuntimeError(f"engine step failed: {e}"))
                self._clear_batch()
        self._abort_all("engine shutting down")

    def _step(self) -> None:
        self._admit()
        self._sample_and_retire()
        if self._running:
            start = time.perf_counter()
            self._decode()
            STEP_SECONDS.observe(time.perf_counter() - start)

    def _admit(self) -> None:
        with self._cond:
            room = self.cfg.max_running_requests - len(self._running)
            limit = min(room, self.cfg.max_prefill_per_step)
            batch = admission.choose(self._waiting, limit, self.prefix_cache)
            WAITING.set(len(self._waiting))
        if batch:
            self._prefill(batch)
        RUNNING.set(len(self._running))

    def _prefill(self, reqs: list[Request]) -> None:
        # A retracted request re-enters with its own generated tokens (all but the last
        # sampled one, which the next decode step feeds in, so its logits come from there).
        seqs = [r.input_ids + r.output_ids[:-1] if r.output_ids else r.input_ids for r in reqs]
        pad_id = self.tokenizer.pad_token_id or 0
        cache = self.prefix_cache
        # The last token is always computed: its logits are what admission is for.
        hits = [cache.match(s[:-1])[1] for s in seqs] if cache else None
        logits, kv, pads, used = prefill(self.model, seqs, pad_id, self.device, hits)
        for i, req in enumerate(reqs):
            req.next_logits = None if req.output_ids else logits[i]
            PREFILL_TOKENS.labels("cached").inc(used[i])
            PREFILL_TOKENS.labels("computed").inc(len(seqs[i]) - used[i])
        self._batch.add(reqs, kv, pads)
        if cache is not None:
            admission.keep_admitted(cache, reqs, seqs, kv, pads, used)
            PREFIX_CACHE_TOKENS.set(cache.stats.tokens)

    def _release_cache(self, req: Request, row: int | None = None) -> None:
        """A request leaves the batch (`row`: its batch row when it finished)."""
        if self.prefix_cache is not None:
            kv = None if row is None else (lambda: self._batch.row_kv(row))
            admission.release(self.prefix_cache, req, kv)
            PREFIX_CACHE_TOKENS.set(self.prefix_cache.stats.tokens)

    def _sample_and_retire(self) -> None:
        keep: list[int] = []
        todo = [r for r in self._running if r.next_logits is not None and not r.cancelled]
        if todo:
            tokens, logprobs = sample_batch(
                torch.stack([r.next_logits for r in todo]),  # type: ignore[misc]
                [r.params for r in todo],
                [r.generator for r in todo],
            )
            for req, token, logprob in zip(todo, tokens, logprobs, strict=True):
                req.next_logits = None
                req.output_ids.append(token)
                req.logprobs.append(logprob)
            GEN_TOKENS.inc(len(todo))
        sampled = {id(r) for r in todo}
        for i, req in enumerate(self._running):
            if req.cancelled:
                self._release_cache(req)
                self._finish(req, {"type": "abort", "message": "client disconnected"})
                continue
            if id(req) in sampled:
                reason = self._finish_reason(req, req.output_ids[-1])
                if reason is not None:
                    self._release_cache(req, row=i)
                    self._finish(req, reason)
                    continue
            keep.append(i)
        if len(keep) != len(self._running):
            self._batch.keep(keep)
            RUNNING.set(len(self._running))

    def _finish_reason(self, req: Request, token: int) -> dict[str, Any] | None:
        return finish_reason(
            req,
            token,
            eos_ids=self.eos_ids,
            context_length=self.context_length,
            decode=self.tokenizer.decode,
        )

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        GEN_REQUESTS.labels(reason["type"]).inc()
        req.resolve(
            final_output(
                req, reason, decode=self.tokenizer.decode, weight_version=self.weight_version
            )
        )

    def _decode(self) -> None:
        logits = self._batch.decode(self.model, [r.output_ids[-1] for r in self._running])
        for req, row in zip(self._running, logits, strict=True):
            req.next_logits = row

    def _clear_batch(self) -> None:
        for req in self._running:  # aborted, retracted or failed: nothing stays locked
            self._release_cache(req)
        self._batch.clear()
        RUNNING.set(0)

    def _abort_all(self, message: str) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
            WAITING.set(0)
        for req in self._running + waiting:
            self._finish(req, {"type": "abort", "message": message})
        self._clear_batch()

    def _retract_all(self) -> None:
        # Back to the front of the queue; re-admission recomputes their KV (under whatever
        # weights are current then), keeping the tokens and logprobs sampled so far.
        with self._cond:
            for req in reversed(self._running):
                req.next_logits = None
                self._waiting.appendleft(req)
            WAITING.set(len(self._waiting))
        self._clear_batch()
