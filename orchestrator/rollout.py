"""The multi-turn search rollout of one sample, token-exact.

Each sample runs its own async loop (`run_sample`), so a sample waiting on a search never holds
back one that is generating; the service starts one task per sample. The context sent to the
engine is always token ids: prompt ids + the engine's own output ids (as returned, stop string
included) + observation ids tokenized once. The engine's logprobs are kept as they came.

Turn semantics (spec section 2):
- slime: `max_turns` generation calls in all (default 2: one usable search, then an answer);
  a turn that ends on its token limit (finish reason length) ends the sample, as in slime;
- original: `max_turns` rounds with search enabled, then one final generation whose search,
  if any, is not executed.
A search on the last generation call is never executed: no further turn could read it.

What follows a model message is its action format's (orchestrator/formats/, one module each):
`search_r1`, the tags above (one tool, `search`); `function_calling`, the chat template's
`<tool_call>` format over any tools; or a task whose environment answers every turn (`env`):
each model message goes to the sample's episode, whose answer is appended as the chat template
renders it, and the task's rubric scores the sample when it ends. The tools run behind their
runners (orchestrator/tools/runner.py): deadlines, retries, the breaker, metrics per tool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from engine_client.client import Generator, InferenceBadRequest, InferenceUnavailable
from orchestrator import metrics
from orchestrator.config import ActionFormat, RolloutConfig, RoutingKey, TurnSemantics
from orchestrator.formats.base import TurnFormat
from orchestrator.formats.environment import EnvTurns
from orchestrator.formats.function_calling import FunctionCallingFormat
from orchestrator.formats.search_r1 import SearchR1Format
from orchestrator.hooks import load_hook
from orchestrator.observation import Observation, Tokenizer
from orchestrator.prompt import prompt_token_ids
from orchestrator.sample import Sample, Status, TurnRecord
from orchestrator.tools.search import SearchTool
from orchestrator.tools.toolbox import Toolbox, entry

log = logging.getLogger(__name__)


# SGLang refuses an input longer than its context length - 6 tokens (`max_req_input_len`).
INPUT_RESERVE = 6


class EngineDown(RuntimeError):
    """The engine stayed unreachable for longer than `engine_retry_s`."""


def _engine_unavailable(exc: BaseException) -> bool:
    """Worth waiting for: the engine is restarting, overloaded or unreachable."""
    return isinstance(exc, ConnectionError | OSError | TimeoutError | InferenceUnavailable)


def _engine_bad_request(exc: BaseException) -> bool:
    return isinstance(exc, InferenceBadRequest)


class Rollout:
    """Runs samples. Also the object a custom generate function receives, with its helpers."""

    def __init__(
        self,
        cfg: RolloutConfig,
        generator: Generator,
        tools: SearchTool | Toolbox,
        tokenizer: Tokenizer,
        *,
        engine_retry_s: float = 600.0,
        greedy: bool = False,
        context_length: int | None = None,
        env: EnvTurns | None = None,
    ) -> None:
        self.cfg = cfg
        # The engine's context (prompt + output): SGLang rejects a request that could exceed
        # it, so each turn asks for at most what still fits.
        self.context_length = context_length
        self.generator = generator
        self.env = env
        if isinstance(tools, SearchTool):  # Search-R1's one tool
            tools = Toolbox([entry(tools, tools.cfg.limits, tools.cfg.failure_observation)])
        self.tools = tools
        tool = tools.get("search")
        self.search_tool: SearchTool | None = tool if isinstance(tool, SearchTool) else None
        self.format: TurnFormat
        if env is not None:
            self.format = env
        elif cfg.action_format == ActionFormat.FUNCTION_CALLING:
            self.format = FunctionCallingFormat(tools, tokenizer)
        elif self.search_tool is None:
            raise ValueError("rollout.action_format search_r1 needs the search tool")
        else:
            self.format = SearchR1Format(self.search_tool, tokenizer, cfg)
        self.stop: list[str] = self.format.stop(cfg)  # what the engine stops on
        self._prompt_cache: OrderedDict[str, list[int]] = OrderedDict()
        self.tokenizer = tokenizer
        self.engine_retry_s = engine_retry_s
        self.greedy = greedy
        self._custom: Callable[[Rollout, Sample], Awaitable[None]] | None = None
        if cfg.custom_generate:
            self._custom = load_hook(
                cfg.custom_generate, field="rollout.custom_generate", n_args=2, is_async=True
            )

    @property
    def temperature(self) -> float:
        """The sampling temperature sent to the engine; 0 = greedy (SGLang: top_k 1)."""
        return 0.0 if self.greedy else self.cfg.temperature

    @property
    def generation_calls(self) -> int:
        extra = 1 if self.cfg.turn_semantics == TurnSemantics.ORIGINAL else 0
        return self.cfg.max_turns + extra

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's ids as this rollout's format renders them (with the tools it passes to
        the chat template, if any)."""
        return prompt_token_ids(self.tokenizer, messages, tools=self.format.prompt_tools())

    def _tool_prompt_ids(self, sample: Sample) -> list[int]:
        """The prompt rendered with the format's tools (cached per prompt, so a group renders it
        once)."""
        key = sample.prompt.prompt_id
        ids = self._prompt_cache.get(key)
        if ids is None:
            ids = self._prompt_cache[key] = self.prompt_ids(sample.prompt.messages)
            if len(self._prompt_cache) > 4096:
                self._prompt_cache.popitem(last=False)
        return list(ids)

    async def run_sample(self, sample: Sample) -> Sample:
        """Run one sample to completion (never raises for engine/tool trouble: status ERROR)."""
        if self.format.tools_in_prompt and not sample.response_ids:
            sample.prompt_ids = self._tool_prompt_ids(sample)
        sample.created_at = time.time()
        sample.temperature = self.temperature  # also for a custom hook that calls the engine
        try:
            if self._custom is not None:
                await self._custom(self, sample)
            else:
                while not await self.step(sample):
                    pass
        except EngineDown as e:
            sample.status, sample.error = Status.ERROR, str(e)
        except Exception as e:
            if not _engine_bad_request(e):  # 4xx: e.g. a prompt beyond the context length
                raise
            sample.status, sample.error = Status.ERROR, f"engine rejected the request: {e}"
        finally:
            if self.env is not None:  # the rubric scores the sample; the episode is closed
                start = time.perf_counter()
                await self.env.finish(sample)
                sample.reward_s = time.perf_counter() - start
        if sample.status is None:
            sample.status = Status.MAX_TURNS
        sample.finished_at = time.time()
        metrics.observe_sample(sample)
        return sample

    async def step(self, sample: Sample) -> bool:
        """One generation call and the action it triggers. True when the sample is done.

        Exposed so a caller can also drive a batch turn by turn (the original's barrier loop,
        used by bench/rollout.py for comparison).
        """
        if sample.status is not None:
            return True
        turn_index = len(sample.turns)
        remaining = self.cfg.max_response_tokens - len(sample.response_ids)
        if remaining <= 0:
            sample.status = Status.RESPONSE_BUDGET
            return True
        max_new = min(self.cfg.max_tokens_per_turn, remaining)
        room = None
        if self.context_length is not None:
            used = len(sample.prompt_ids) + len(sample.response_ids)
            room = self.context_length - used
            if room <= 0 or used > self.context_length - INPUT_RESERVE:
                sample.status = Status.CONTEXT_LIMIT
                return True
            max_new = min(max_new, room)
        result, latency = await self.generate(sample, max_new)
        cached = int(getattr(result, "cached_tokens", 0))  # a custom engine may not report it
        self._count_prefix(sample, cached)
        ids = list(result.output_ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        sample.append_model(ids, result.logprobs, text)
        # A push may land mid-turn: the turn's first token came from its start version, and
        # staleness is counted from there (the oldest weights in the sample).
        start_version = int(result.start_weight_version)
        sample.weight_versions += [start_version, int(result.weight_version)]
        turn = TurnRecord(
            index=turn_index,
            action="none",
            generated_tokens=len(ids),
            generate_latency_s=latency,
            engine_finish_reason=str(result.finish_reason),
            weight_version=start_version,
            cached_tokens=cached,
        )
        sample.turns.append(turn)
        sample.generate_s += latency
        if result.finish_reason == "abort":
            sample.status, sample.error = Status.ABORTED, "engine aborted the request"
            return True
        return await self.format.act(self, sample, turn, text, result, max_new, room)

    def stop_before_observing(
        self, sample: Sample, turn_index: int, result: Any, max_new: int, room: int | None
    ) -> Status | None:
        """Why a sample whose turn asked for an observation ends here (None: it goes on)."""
        if result.finish_reason == "length" and self.cfg.turn_semantics == TurnSemantics.SLIME:
            # slime's generate stops the sample on a cut turn (no correction, no next turn).
            return self.length_status(sample, len(result.output_ids), max_new, room)
        if turn_index + 1 >= self.generation_calls:
            return Status.MAX_TURNS
        if len(sample.response_ids) >= self.cfg.max_response_tokens:
            return Status.RESPONSE_BUDGET
        return None

    def observe(self, sample: Sample, turn: TurnRecord, obs: Observation) -> bool:
        """Append the observation (loss mask 0); True when it does not fit and the sample ends."""
        if len(sample.response_ids) + len(obs.ids) >= self.cfg.max_response_tokens:
            # No room for the observation and a further turn: end here, honestly labelled.
            sample.status = Status.RESPONSE_BUDGET
            return True
        sample.append_observation(obs.ids, obs.text)
        turn.observation_tokens = len(obs.ids)
        return False

    @staticmethod
    def _count_prefix(sample: Sample, cached: int) -> None:
        """What the engine could have served from its cache for this call, and what it did."""
        if sample.turns:
            turn = "later"
            cacheable = len(sample.prompt_ids) + len(sample.response_ids)
            cacheable -= sample.turns[-1].observation_tokens  # new since the previous call
        else:
            turn, cacheable = "first", len(sample.prompt_ids)
        metrics.PREFIX_TOKENS.labels(turn, "cacheable").inc(cacheable)
        metrics.PREFIX_TOKENS.labels(turn, "cached").inc(cached)

    def length_status(
        self, sample: Sample, generated: int, max_new: int, room: int | None = None
    ) -> Status:
        """Why a turn ended on "length": the engine's context, the whole-response budget, or
        the per-turn limit."""
        if generated < max_new or (room is not None and generated >= room):
            return Status.CONTEXT_LIMIT  # the context is full (or the engine stopped short)
        if len(sample.response_ids) >= self.cfg.max_response_tokens:
            return Status.RESPONSE_BUDGET
        return Status.TRUNCATED

    def routing_key(self, sample: Sample) -> str | None:
        """The key that keeps this sample's calls on the engine holding its prefix."""
        if self.cfg.routing_key == RoutingKey.GROUP:
            return sample.group_id
        if self.cfg.routing_key == RoutingKey.SAMPLE:
            return sample.trajectory_id
        return None

    async def generate(self, sample: Sample, max_new_tokens: int) -> tuple[Any, float]:
        """One engine call on the sample's token context; waits out engine restarts.

        An aborted call (the trainer paused generation with `abort` for a weight update) is
        discarded and re-issued, up to `max_abort_retries` times: the turn is regenerated in
        full by the new weights rather than stitched from two policies.
        """
        context = sample.prompt_ids + sample.response_ids
        # Recorded on the sample: the engine's logprobs are of logits / T, the trainer needs T.
        sample.temperature = temperature = self.temperature
        deadline = time.monotonic() + self.engine_retry_s
        delay = 0.5
        aborts = 0
        while True:
            start = time.perf_counter()
            try:
                result = await self.generator.generate(
                    context,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=1.0 if self.greedy else self.cfg.top_p,
                    top_k=1 if self.greedy else self.cfg.top_k,
                    stop=list(self.stop),
                    no_stop_trim=True,
                    return_logprob=True,
                    # The call and its own retries end with this sample's budget.
                    deadline_s=max(deadline - time.monotonic(), 1.0),
                    routing_key=self.routing_key(sample),
                )
                if result.finish_reason == "abort" and aborts < self.cfg.max_abort_retries:
                    aborts += 1
                    metrics.ENGINE_ABORTS.inc()
                    await asyncio.sleep(min(0.1 * aborts, 2.0))
                    continue
                return result, time.perf_counter() - start
            except Exception as e:
                if not _engine_unavailable(e):
                    raise
                if time.monotonic() + delay > deadline:
                    raise EngineDown(f"engine unavailable for {self.engine_retry_s}s: {e}") from e
                metrics.ENGINE_RETRIES.inc()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
