"""The engine's scheduler: continuous batching on one thread that owns the model.

Each iteration it
1. runs queued control commands (weight updates, pause, flush) - so they land between decode
   steps;
2. admits waiting requests: those arriving together are prefilled together (left-padded),
   each on top of its longest cached prefix when the prefix cache is on (`prefix_cache.py`;
   `admission.py` chooses each pass and keeps the cache's entries of it);
3. samples one token for every running request from its last logits and retires finished ones;
4. runs ONE batched decode step over the remaining requests.
The running batch (`inference.batch.RunningBatch`) keeps a left-padded KV cache that grows by
one column per step; requests join and leave between steps without waiting for the rest of
the batch, and a request's tokens do not depend on its neighbours beyond floating-point noise.

No decode step runs while generation is paused (`inference.pause`) or memory is released
(`inference.memory`); commands still do.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import Counter, Gauge, Histogram

from inference import admission
from inference.batch import RunningBatch, prefill
from inference.config import TorchEngineConfig
from inference.memory import MemoryState
from inference.pause import PauseLease
from inference.prefix_cache import PrefixCache
from inference.requests import CommandResult, Request
from inference.sampling import sample_batch
from inference.stopping import final_output, finish_reason

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
PREFILL_TOKENS = Counter(
    "searchr1_inference_prefill_tokens_total",
    "Prompt (and re-admitted) tokens at admission: computed by a prefill, or served from the "
    "prefix cache",
    ["source"],
)
PREFIX_CACHE_TOKENS = Gauge(
    "searchr1_inference_prefix_cache_tokens", "Tokens held in the prefix cache"
)


class EngineOverloaded(Exception):
    """The waiting queue is full (HTTP 429)."""


class EngineStopped(Exception):
    """The engine is shutting down."""


class Scheduler:
    """The waiting queue, the running batch and the thread that steps them."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        cfg: TorchEngineConfig,
        *,
        eos_ids: set[int],
        context_length: int,
        memory: MemoryState,
        pause: PauseLease,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.memory = memory
        self.pause = pause
        self.weight_version = 0
        # Used by the scheduler thread only (commands included), so it needs no lock.
        budget = cfg.prefix_cache_tokens
        self.prefix_cache = PrefixCache(budget) if budget else None
        self._cond = threading.Condition()
        self.waiting: deque[Request] = deque()
        self._commands: deque[tuple[Callable[[], Any], CommandResult]] = deque()
        self.batch = RunningBatch(torch.device(cfg.device))
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish every request with abort and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ---- from the event loop ---------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue a request. EngineStopped, MemoryReleased, EngineOverloaded: refused."""
        with self._cond:
            if self._stopping:
                raise EngineStopped("engine is shutting down")
            self.memory.refuse_generation()  # MemoryReleased: a 503
            if len(self.waiting) >= self.cfg.max_queued_requests:
                REJECTED.labels("overloaded").inc()
                raise EngineOverloaded(
                    f"{len(self.waiting)} requests waiting (max_queued_requests)"
                )
            self.waiting.append(req)
            WAITING.set(len(self.waiting))
            self._cond.notify_all()

    async def run_command(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the scheduler thread between decode steps (even while paused)."""
        result = CommandResult(asyncio.get_running_loop())
        with self._cond:
            self._commands.append((fn, result))
            self._cond.notify_all()
        return await result.future

    # ---- commands (scheduler thread) -------------------------------------------------------

    @property
    def running(self) -> list[Request]:
        return self.batch.rows

    @property
    def held(self) -> bool:
        """No decode step runs: paused, or memory released (retracted requests wait)."""
        return self.pause.paused or not self.memory.serving

    def waiting_count(self) -> int:
        with self._cond:
            return len(self.waiting)

    def set_version(self, version: int | None) -> int:
        if version is not None and version != self.weight_version:
            # Like SGLang: requests in flight record where their weights changed, so their
            # answer lists the versions that produced each span of their output.
            with self._cond:
                live = [*self.running, *self.waiting]
            for req in live:
                if req.output_ids:
                    req.version_events.append((self.weight_version, len(req.output_ids)))
            self.weight_version = version
        return self.weight_version

    def flush_prefix_cache(self) -> None:
        """Drop the prefix cache, as SGLang does on every weight update. Running requests keep
        their K/V but, being of the old generation, do not insert it."""
        if self.prefix_cache is not None:
            self.prefix_cache.flush()
            PREFIX_CACHE_TOKENS.set(0)

    def flush_kv(self) -> None:
        """Every K/V held: the prefix cache's and the batch's (memory release)."""
        self.flush_prefix_cache()
        self.batch.clear()

    def abort_all(self, message: str) -> None:
        with self._cond:
            waiting = list(self.waiting)
            self.waiting.clear()
            WAITING.set(0)
        for req in self.running + waiting:
            self._finish(req, {"type": "abort", "message": message})
        self._clear_batch()

    def retract_all(self) -> None:
        # Back to the front of the queue; re-admission recomputes their KV (under whatever
        # weights are current then), keeping the tokens and logprobs sampled so far.
        with self._cond:
            for req in reversed(self.running):
                req.next_logits = None
                self.waiting.appendleft(req)
            WAITING.set(len(self.waiting))
        self._clear_batch()

    # ---- the thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while (
                    not self._stopping
                    and not self._commands
                    and (self.held or (not self.waiting and not self.running))
                ):
                    if self.pause.paused:
                        left = self.pause.left()
                        if left <= 0:
                            self.pause.expire()
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
            if self.held:
                continue
            try:
                self._step()
            except Exception as e:  # a bug must not kill the thread silently: fail the batch
                log.exception("engine step failed")
                for req in self.running:
                    req.resolve(RuntimeError(f"engine step failed: {e}"))
                self._clear_batch()
        self.abort_all("engine shutting down")

    def _step(self) -> None:
        self._admit()
        self._sample_and_retire()
        if self.running:
            start = time.perf_counter()
            self._decode()
            STEP_SECONDS.observe(time.perf_counter() - start)

    def _admit(self) -> None:
        with self._cond:
            room = self.cfg.max_running_requests - len(self.running)
            limit = min(room, self.cfg.max_prefill_per_step)
            batch = admission.choose(self.waiting, limit, self.prefix_cache)
            WAITING.set(len(self.waiting))
        if batch:
            self._prefill(batch)
        RUNNING.set(len(self.running))

    def _prefill(self, reqs: list[Request]) -> None:
        # A retracted request re-enters with its own generated tokens (all but the last
        # sampled one, which the next decode step feeds in, so its logits come from there).
        seqs = [r.input_ids + r.output_ids[:-1] if r.output_ids else r.input_ids for r in reqs]
        pad_id = self.tokenizer.pad_token_id or 0
        cache = self.prefix_cache
        # The last token is always computed: its logits are what admission is for.
        hits = [cache.match(s[:-1])[1] for s in seqs] if cache else None
        logits, kv, pads, used = prefill(self.model, seqs, pad_id, self.batch.device, hits)
        for i, req in enumerate(reqs):
            req.next_logits = None if req.output_ids else logits[i]
            PREFILL_TOKENS.labels("cached").inc(used[i])
            PREFILL_TOKENS.labels("computed").inc(len(seqs[i]) - used[i])
        self.batch.add(reqs, kv, pads)
        if cache is not None:
            admission.keep_admitted(cache, reqs, seqs, kv, pads, used)
            PREFIX_CACHE_TOKENS.set(cache.stats.tokens)

    def _release_cache(self, req: Request, row: int | None = None) -> None:
        """A request leaves the batch (`row`: its batch row when it finished)."""
        if self.prefix_cache is not None:
            kv = None if row is None else (lambda: self.batch.row_kv(row))
            admission.release(self.prefix_cache, req, kv)
            PREFIX_CACHE_TOKENS.set(self.prefix_cache.stats.tokens)

    def _sample_and_retire(self) -> None:
        keep: list[int] = []
        todo = [r for r in self.running if r.next_logits is not None and not r.cancelled]
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
        for i, req in enumerate(self.running):
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
        if len(keep) != len(self.running):
            self.batch.keep(keep)
            RUNNING.set(len(self.running))

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
        logits = self.batch.decode(self.model, [r.output_ids[-1] for r in self.running])
        for req, row in zip(self.running, logits, strict=True):
            req.next_logits = row

    def _clear_batch(self) -> None:
        for req in self.running:  # aborted, retracted or failed: nothing stays locked
            self._release_cache(req)
        self.batch.clear()
        RUNNING.set(0)
