"""Routing over several engines from the client: prefix affinity, least-loaded, failover.

`EnginePool` speaks the part of `InferenceClient`'s API that the orchestrator uses (generate,
model info) over a list of engine URLs, for deployments without sglang-router (compose, a local
run with two engines) and wherever every engine must be asked (weight versions):

- **Affinity.** A call with a `routing_key` goes to the engine its key was first sent to, so the
  turns of a sample (and, keyed by group, the samples of a group) meet the prefix cache their
  earlier calls filled. A new key goes to the least-loaded engine (fewest calls in flight, then
  fewest keys), which is also how load rebalances when an engine joins or comes back: new keys
  fill it, existing keys stay where their cache is (sglang-router's `manual` policy with
  `--assignment-mode min_load` does the same).
- **Failover.** An engine that fails a call (connection error, timeout or 5xx after the client's
  retries) is skipped for `retry_down_s`, then tried again; its keys move to the least-loaded
  engine that is up, where they stay. The failed call is the caller's to retry (the
  orchestrator's rollout does), and its retry lands on the new engine.
- **Frozen engines.** With `probe_s` set, every engine's `/health` is asked every `probe_s`
  seconds, each answer due within `probe_timeout_s`. An engine that misses `probe_misses` in a
  row is frozen (a GC pause, a stuck CUDA call, SIGSTOP: its connections stay open and nothing
  answers, so no call fails by itself before its own long deadline): it is avoided until a probe
  is answered again, and its calls in flight are given up at once as unavailable, so their
  callers retry them on an engine that answers.
- **Saturation.** With `spill_at_in_flight` set (an engine's `--max-running-requests`), a call
  whose engine already runs that many goes to the least-loaded one instead, without moving its
  key: one turn re-prefills rather than waits in a queue.
- **Versions.** `get_model_info` asks every engine that is up and reports the OLDEST weight
  version among them: a step that waits for version k starts only when every engine serves it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge

from engine_client.client import GenerateResult, InferenceClient, InferenceUnavailable

ROUTED = Counter(
    "searchr1_inference_pool_routed_total",
    "Calls EnginePool sent, by engine and why there (sticky: the key's engine; assigned: a new "
    "key, least-loaded; failover: the key's engine was down; spill: it was saturated; unkeyed)",
    ["engine", "how"],
)
IN_FLIGHT = Gauge("searchr1_inference_pool_in_flight", "Calls in flight per engine", ["engine"])
DOWN = Counter(
    "searchr1_inference_pool_engine_down_total", "Times an engine was marked down", ["engine"]
)
FROZEN = Counter(
    "searchr1_inference_pool_engine_frozen_total",
    "Times an engine stopped answering its health probe (its calls in flight given up)",
    ["engine"],
)
log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class PooledEngine:
    url: str
    client: InferenceClient
    in_flight: int = 0
    keys: int = 0  # routing keys pinned here
    down_until: float = 0.0  # monotonic time; up when in the past
    misses: int = 0  # health probes unanswered in a row
    frozen: bool = False  # missed probe_misses probes; up again at its next answer
    calls: set[asyncio.Future[Any]] = field(default_factory=set)  # in flight (probing only)

    def is_up(self, now: float) -> bool:
        return now >= self.down_until and not self.frozen


class EnginePool:
    def __init__(
        self,
        urls: list[str],
        make_client: Callable[[str], InferenceClient],
        *,
        spill_at_in_flight: int | None = None,
        retry_down_s: float = 5.0,
        max_keys: int = 65536,
        probe_s: float | None = None,
        probe_timeout_s: float = 5.0,
        probe_misses: int = 2,
        discover: Callable[[], Awaitable[list[str]]] | None = None,
        discover_s: float = 5.0,
    ) -> None:
        """`discover`: the current engine URLs (engines added or gone during the run), asked
        every `discover_s` seconds; the pool follows them (`set_urls`)."""
        if not urls:
            raise ValueError("EnginePool needs at least one engine URL")
        urls = [url.rstrip("/") for url in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"EnginePool: duplicate engine URLs in {urls}")
        self._make_client = make_client
        self.engines = [PooledEngine(url, make_client(url)) for url in urls]
        self.discover, self.discover_s = discover, discover_s
        self._discoverer: asyncio.Task[None] | None = None
        self.spill_at_in_flight = spill_at_in_flight
        self.retry_down_s = retry_down_s
        self.max_keys = max_keys
        self._key_engine: OrderedDict[str, PooledEngine] = OrderedDict()  # LRU order
        self._turn = itertools.count()  # breaks ties between equally loaded engines
        self.probe_s, self.probe_timeout_s, self.probe_misses = (
            probe_s,
            probe_timeout_s,
            probe_misses,
        )
        self._prober: asyncio.Task[None] | None = None

    @property
    def vocab_size(self) -> int | None:
        return self.engines[0].client.vocab_size

    @vocab_size.setter
    def vocab_size(self, value: int | None) -> None:
        for engine in self.engines:
            engine.client.vocab_size = value

    async def set_urls(self, urls: list[str]) -> None:
        """Follow the run's engines: new ones join (new keys fill them: least-loaded), gone
        ones leave (their keys move at their next call; their calls in flight fail over)."""
        urls = list(dict.fromkeys(u.rstrip("/") for u in urls))
        if not urls:
            raise ValueError("EnginePool needs at least one engine URL")
        have = {e.url: e for e in self.engines}
        gone = [e for e in self.engines if e.url not in urls]
        if not gone and len(have) == len(urls):
            return
        vocab = self.vocab_size
        self.engines = [have.get(u) or PooledEngine(u, self._make_client(u)) for u in urls]
        self.vocab_size = vocab
        for key in [k for k, e in self._key_engine.items() if e in gone]:
            del self._key_engine[key]
        log.info("engines changed", extra={"engines": urls, "gone": [e.url for e in gone]})
        await asyncio.gather(*(e.client.aclose() for e in gone), return_exceptions=True)

    async def _discover_forever(self) -> None:
        assert self.discover is not None
        while True:
            await asyncio.sleep(self.discover_s)
            try:
                await self.set_urls(await self.discover())
            except Exception as e:  # the engines stay as they were; asked again next time
                log.warning("engine discovery failed", extra={"error": str(e)})

    def route(self, routing_key: str | None) -> tuple[PooledEngine, str]:
        """The engine for the next call with this key, and why it was chosen."""
        if self.discover is not None and self._discoverer is None:
            self._discoverer = asyncio.get_running_loop().create_task(self._discover_forever())
        now = time.monotonic()
        if routing_key is None:
            return self._least_loaded(now), "unkeyed"
        pinned = self._key_engine.get(routing_key)
        if pinned is None:
            engine = self._least_loaded(now)
            self._pin(routing_key, engine)
            return engine, "assigned"
        self._key_engine.move_to_end(routing_key)
        if not pinned.is_up(now) and any(e.is_up(now) for e in self.engines):
            engine = self._least_loaded(now)
            self._pin(routing_key, engine)
            return engine, "failover"  # (with every engine down, the key tries its own)
        if self.spill_at_in_flight is not None and pinned.in_flight >= self.spill_at_in_flight:
            engine = self._least_loaded(now)
            if engine.in_flight < pinned.in_flight:
                return engine, "spill"
        return pinned, "sticky"

    def _least_loaded(self, now: float) -> PooledEngine:
        up = [(i, e) for i, e in enumerate(self.engines) if e.is_up(now)]
        candidates = up or list(enumerate(self.engines))
        turn, n = next(self._turn), len(self.engines)
        return min(candidates, key=lambda c: (c[1].in_flight, c[1].keys, (c[0] - turn) % n))[1]

    def _pin(self, key: str, engine: PooledEngine) -> None:
        old = self._key_engine.pop(key, None)
        if old is not None:
            old.keys -= 1
        self._key_engine[key] = engine
        engine.keys += 1
        while len(self._key_engine) > self.max_keys:
            _, evicted = self._key_engine.popitem(last=False)
            evicted.keys -= 1

    def mark_down(self, engine: PooledEngine) -> None:
        engine.down_until = time.monotonic() + self.retry_down_s
        DOWN.labels(engine.url).inc()

    async def generate(
        self, input_ids: list[int], *, routing_key: str | None = None, **kwargs: Any
    ) -> GenerateResult:
        engine, how = self.route(routing_key)
        ROUTED.labels(engine.url, how).inc()
        engine.in_flight += 1
        IN_FLIGHT.labels(engine.url).inc()
        try:
            return await self._call(
                engine, engine.client.generate(input_ids, routing_key=routing_key, **kwargs)
            )
        except InferenceUnavailable:
            self.mark_down(engine)
            raise
        finally:
            engine.in_flight -= 1
            IN_FLIGHT.labels(engine.url).dec()

    async def get_model_info(self) -> dict[str, Any]:
        """The first engine's model info, with the oldest weight version among the engines
        that answer; unavailable only when none does."""
        asked = [e for e in self.engines if not e.frozen] or self.engines
        answers = await asyncio.gather(
            *(self._call(e, e.client.get_model_info()) for e in asked), return_exceptions=True
        )
        infos: list[dict[str, Any]] = []
        failed: list[str] = [f"{e.url}: frozen" for e in self.engines if e not in asked]
        for engine, answer in zip(asked, answers, strict=True):
            if isinstance(answer, InferenceUnavailable):
                self.mark_down(engine)
                failed.append(f"{engine.url}: {answer}")
            elif isinstance(answer, BaseException):
                raise answer
            else:
                infos.append(answer)
        if not infos:
            raise InferenceUnavailable("no engine answered: " + "; ".join(failed))
        info = dict(infos[0])
        info["weight_version"] = min(i["weight_version"] for i in infos)
        info["engines_answered"] = len(infos)
        return info

    async def _call(self, engine: PooledEngine, call: Awaitable[T]) -> T:
        """`call` on `engine`; given up as unavailable if the engine freezes meanwhile."""
        if self.probe_s is None:
            return await call
        if self._prober is None:
            self._prober = asyncio.create_task(self._probe_forever())
        future = asyncio.ensure_future(call)
        engine.calls.add(future)
        try:
            return await future
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if engine.frozen and not (task is not None and task.cancelling()):
                raise InferenceUnavailable(f"{engine.url}: stopped answering /health") from None
            raise  # our caller was cancelled
        finally:
            engine.calls.discard(future)

    async def _probe_forever(self) -> None:
        assert self.probe_s is not None
        while True:
            await asyncio.gather(*(self._probe(e) for e in self.engines))
            await asyncio.sleep(self.probe_s)

    async def _probe(self, engine: PooledEngine) -> None:
        if await engine.client.health(self.probe_timeout_s):
            if engine.frozen:
                log.warning("engine answers again", extra={"engine": engine.url})
            engine.misses, engine.frozen = 0, False
            return
        engine.misses += 1
        if engine.misses >= self.probe_misses and not engine.frozen:
            engine.frozen = True
            FROZEN.labels(engine.url).inc()
            log.warning(
                "engine frozen: avoided until it answers, its calls in flight given up",
                extra={"engine": engine.url, "misses": engine.misses, "calls": len(engine.calls)},
            )
            for future in list(engine.calls):
                future.cancel()

    async def aclose(self) -> None:
        if self._discoverer is not None:
            self._discoverer.cancel()
            await asyncio.gather(self._discoverer, return_exceptions=True)
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)
        for engine in self.engines:
            await engine.client.aclose()
