"""The gateway: OpenAI chat calls in, token-exact sessions out (docs/gateway.md).

`Gateway.chat` renders nothing the policy generated: it finds where the request goes in its
session (`gateway.bridge.match`), builds the context in token ids, calls the engine with them
(`return_logprob`, the session id as routing key), and records the output ids as they came.
`reward` / `end` close sessions; `reap` enforces the deadlines. Usable without HTTP:
`gateway.server` is a thin layer over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine_client.client import Generator, InferenceBadRequest, InferenceUnavailable
from gateway import metrics
from gateway.bridge import Extend, Fork, ModelCall, Renderer, Replay, Segment, match
from gateway.config import GatewayConfig, HistoryEdits
from gateway.errors import GatewayError
from gateway.openai_api import (
    ChatReply,
    ChatRequest,
    canonical_messages,
    check_tools,
    message_key,
    openai_tool_call,
    returned_message,
    tools_key,
)
from gateway.publish import Publisher
from gateway.sessions import Ident, Session, SessionTable
from searchr1.chat_template import parse_tool_calls, strip_tool_calls

log = logging.getLogger(__name__)

# SGLang refuses an input longer than its context length - 6 tokens (`max_req_input_len`).
INPUT_RESERVE = 6


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int
    stop: list[str]
    seed: int | None


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        engine: Generator,
        renderer: Renderer,
        publisher: Publisher,
        *,
        model_name: str,
        context_length: int | None = None,
        table: SessionTable | None = None,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.renderer = renderer
        self.publisher = publisher
        self.model_name = model_name
        self.context_length = context_length
        self.table = table or SessionTable(
            max_sessions=cfg.max_sessions,
            session_timeout_s=cfg.session_timeout_s,
            group_timeout_s=cfg.group_timeout_s,
            ended_ids_kept=cfg.ended_ids_kept,
        )
        self._slots = asyncio.Semaphore(cfg.max_in_flight)

    # -- sessions ---------------------------------------------------------------------------

    def open_session(self, ident: Ident, timeout_s: float | None = None) -> Session:
        """Register a session (the runner does, before its agent's first call)."""
        return self.table.open(ident, timeout_s)

    def reward(
        self,
        session_id: str,
        value: float,
        *,
        turn: int | None = None,
        components: dict[str, float] | None = None,
    ) -> None:
        """The session's final reward (`turn` None; the same value again is a no-op), or the
        reward of its call `turn`."""
        s = self.table.get(session_id)
        if turn is not None:
            s.turn(turn).reward = value
            return
        if s.reward is not None and s.reward != value:
            raise GatewayError(
                409,
                "reward_conflict",
                f"session {session_id!r} has the final reward {s.reward} already (not {value})",
            )
        s.reward = value
        s.components = dict(components or {})

    async def end(
        self,
        session_id: str,
        reward: float | None = None,
        components: dict[str, float] | None = None,
    ) -> str:
        """End the session (after its call in flight, if any): kept for its group with a final
        reward, dead-lettered without one. Returns which."""
        s = self.table.get(session_id)
        if reward is not None:
            self.reward(session_id, reward, components=components)
        async with self._locked(s):
            self.table.get(session_id)  # ended while we waited
            if s.reward is None:
                self._kill(s, "no_reward", "the session ended without a final reward")
            else:
                self._close(s)
        return "dead_lettered" if s.dead else "ended"

    def _close(self, s: Session) -> None:
        s.ended = True
        now = time.time()
        for seg in s.segments:
            seg.finished_at = seg.finished_at or now
        self._finish_group(s)

    def _kill(self, s: Session, reason: str, error: str) -> None:
        s.dead = reason
        s.ended = True
        self.publisher.dead_letter(s, reason, error)
        self._finish_group(s)

    def _finish_group(self, s: Session, *, force: bool = False) -> None:
        group = s.group
        if group.id not in self.table.groups or not (force or group.done()):
            return
        self.table.remove(group)
        self.publisher.publish(group.id, group.rewarded())

    def reap(self) -> None:
        """Enforce the deadlines once: sessions open past theirs end (kept when they have a
        final reward, else dead-lettered), groups past theirs end with their open sessions
        dead-lettered."""
        sessions, groups = self.table.expired()
        for s in sessions:
            if s.reward is not None:
                self._close(s)
            else:
                self._kill(s, "deadline", "no final reward within the session's deadline")
        for group in groups:
            for s in list(group.sessions.values()):
                if not s.ended:
                    self._kill(s, "incomplete_group", "the group's deadline passed first")
            if group.id in self.table.groups:
                if len(group.sessions) < group.size:
                    log.warning(
                        "group ended short of its size",
                        extra={"group_id": group.id, "joined": len(group.sessions)},
                    )
                first = next(iter(group.sessions.values()), None)
                if first is None:
                    self.table.remove(group)
                else:
                    self._finish_group(first, force=True)

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.reap_interval_s)
            try:
                self.reap()
            except Exception:  # the next round tries again; never a dead reaper
                log.exception("reaping sessions failed")

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Live sessions are dead-lettered (their agents cannot reach us any more); groups'
        rewarded sessions are published; waits for the bus."""
        for s in list(self.table.sessions.values()):
            if not s.ended:
                self._kill(s, "shutdown", "the gateway stopped before the session ended")
        for group in list(self.table.groups.values()):
            first = next(iter(group.sessions.values()), None)
            if first is not None:
                self._finish_group(first, force=True)
        await self.publisher.drain(timeout_s)

    # -- chat -------------------------------------------------------------------------------

    async def chat(self, req: ChatRequest, ident: Ident, *, registered: bool = False) -> ChatReply:
        """One chat completion for the session `ident` names: made on its first call unless
        `registered` (then it must have been opened before)."""
        req.check()
        tools = check_tools(req.tools)
        parse_calls = req.parse_tool_calls()
        stops = req.stops()
        messages = canonical_messages(req.messages)
        keys = [message_key(m) for m in messages]
        tkey = tools_key(tools)
        temperature = req.temperature if self.cfg.temperature is None else self.cfg.temperature
        temperature = 1.0 if temperature is None else temperature
        top_p = req.top_p if self.cfg.top_p is None else self.cfg.top_p

        s = self.table.find(ident.session_id)
        if s is None and not registered and ident.session_id not in self.table.ended:
            s = self.table.open(ident)
        else:
            s = self.table.get(ident.session_id)
        async with self._locked(s):
            self.table.get(s.id)  # ended while we waited
            where = match(s.segments, messages, keys, tkey, temperature)
            if isinstance(where, Replay):
                metrics.CHAT.labels("replay").inc()
                assert where.segment.last_reply is not None
                return where.segment.last_reply
            seg: Segment | None = None
            bridge: list[int] = []
            reason = ""
            if isinstance(where, Extend):
                seg = where.segment
                try:
                    bridge = self.renderer.bridge(seg.last_text, where.new, tools, tkey)
                except ValueError:
                    seg, where = None, Fork("template")  # it cannot append them token-exactly
            if isinstance(where, Fork):
                reason = where.reason
                if reason and self.cfg.history_edits == HistoryEdits.REJECT:
                    raise GatewayError(
                        409,
                        "history_edit",
                        f"the messages do not extend session {s.id!r} ({reason}): send the "
                        "history as the gateway returned it, or start another session",
                    )
                prompt = self.renderer.prompt(messages, tools)
                context = prompt
            else:
                assert seg is not None
                context = seg.context() + bridge
            sampling = Sampling(
                temperature, top_p or 1.0, self._max_new(req, len(context)), stops, req.seed
            )
            result, latency = await self._generate(context, sampling, s.id)
            if s.ended:  # the deadline passed while the engine worked: nothing recorded
                raise GatewayError(409, "session_ended", f"session {s.id!r} ended meanwhile")
            if seg is None:
                if reason:
                    metrics.FORKS.labels(reason).inc()
                    log.info("new segment", extra={"session_id": s.id, "reason": reason})
                seg = Segment(len(s.segments), reason or "start", prompt, tkey, temperature, [])
                s.segments.append(seg)
                metrics.TOKENS.labels("prompt").inc(len(prompt))
            else:
                seg.append_bridge(bridge)
                metrics.TOKENS.labels("bridge").inc(len(bridge))
            reply = self._record(
                s, seg, result, latency, len(bridge), parse_calls, stops, len(context)
            )
            seg.seen = [*keys, message_key(returned_message(reply))]
            seg.last_request = keys
            seg.last_reply = reply
            metrics.CHAT.labels("turn").inc()
            return reply

    def _record(
        self,
        s: Session,
        seg: Segment,
        result: Any,
        latency: float,
        bridge_tokens: int,
        parse_calls: bool,
        stops: list[str],
        prompt_tokens: int,
    ) -> ChatReply:
        """Append the engine's output to the segment; the answer the client gets."""
        ids = [int(t) for t in result.output_ids]
        seg.append_output(ids, result.logprobs)
        metrics.TOKENS.labels("generated").inc(len(ids))
        seg.last_text = self.renderer.decode(ids)
        start_version = int(result.start_weight_version)
        seg.weight_versions += [start_version, int(result.weight_version)]
        seg.generate_s += latency
        turn = ModelCall(
            index=s.turns,
            bridge_tokens=bridge_tokens,
            generated_tokens=len(ids),
            latency_s=latency,
            finish_reason=str(result.finish_reason),
            weight_version=start_version,
            cached_tokens=int(getattr(result, "cached_tokens", 0) or 0),
        )
        s.turns += 1
        seg.turns.append(turn)
        text = self.renderer.visible_text(ids, turn.finish_reason, result.matched_stop, stops)
        finish = "length" if turn.finish_reason == "length" else "stop"
        content, calls = text, []
        parsed = parse_tool_calls(text) if parse_calls else []
        if parsed and all(not c.error for c in parsed):
            content = strip_tool_calls(text).strip()
            calls = [openai_tool_call(c.name, c.arguments) for c in parsed]
            turn.tool_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            finish = "tool_calls"
        elif parsed:
            metrics.MALFORMED_CALLS.inc()
            turn.error = "; ".join(c.error for c in parsed if c.error)
        return ChatReply(content, calls, finish, prompt_tokens, len(ids), self.model_name)

    def _max_new(self, req: ChatRequest, used: int) -> int:
        want = req.max_completion_tokens or req.max_tokens or self.cfg.max_tokens
        if self.context_length is None:
            return want
        if used > self.context_length - INPUT_RESERVE:
            raise GatewayError(
                400,
                "context_length_exceeded",
                f"the conversation is {used} tokens; the model's context is {self.context_length}",
            )
        return max(1, min(want, self.context_length - used))

    @contextlib.asynccontextmanager
    async def _locked(self, s: Session) -> AsyncIterator[None]:
        """The session's calls one at a time (each extends what the previous one recorded)."""
        try:
            await asyncio.wait_for(s.lock.acquire(), self.cfg.queue_timeout_s)
        except TimeoutError:
            raise GatewayError(
                429, "busy", f"session {s.id!r} is busy with another call (queue_timeout_s)"
            ) from None
        try:
            yield
        finally:
            s.lock.release()

    async def _generate(self, ids: list[int], p: Sampling, session_id: str) -> tuple[Any, float]:
        """One engine call (a free slot waited for); an aborted one (a weight update) is
        generated again in full, up to `max_abort_retries` times."""
        try:
            await asyncio.wait_for(self._slots.acquire(), self.cfg.queue_timeout_s)
        except TimeoutError:
            raise GatewayError(429, "busy", "no engine slot free (max_in_flight)") from None
        start = time.perf_counter()
        try:
            for attempt in range(self.cfg.max_abort_retries + 1):
                if attempt:
                    metrics.ENGINE_ABORTS.inc()
                    await asyncio.sleep(min(0.1 * attempt, 2.0))
                result = await self._engine_call(ids, p, session_id)
                if result.finish_reason != "abort":
                    return result, time.perf_counter() - start
            raise GatewayError(
                503,
                "engine_aborted",
                f"the engine aborted the call {self.cfg.max_abort_retries + 1} times",
            )
        finally:
            self._slots.release()
            metrics.ENGINE_LATENCY.observe(time.perf_counter() - start)

    async def _engine_call(self, ids: list[int], p: Sampling, session_id: str) -> Any:
        context = {"session_id": session_id, "input_tokens": len(ids)}
        try:
            return await self.engine.generate(
                ids,
                max_new_tokens=p.max_new_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=1 if p.temperature == 0 else -1,
                stop=p.stop,
                no_stop_trim=True,  # the ids keep the stop string: they are what was sampled
                return_logprob=True,
                seed=p.seed,
                deadline_s=self.cfg.engine_retry_s,
                routing_key=session_id,
            )
        except InferenceBadRequest as e:
            log.warning("engine refused a call", extra={**context, "error": str(e)})
            raise GatewayError(400, "engine_rejected", f"the engine refused: {e}") from None
        except (InferenceUnavailable, OSError, TimeoutError) as e:
            log.warning("engine unavailable", extra={**context, "error": repr(e)})
            raise GatewayError(503, "engine_unavailable", f"engine unavailable: {e}") from None
