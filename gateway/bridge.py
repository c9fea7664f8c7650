"""The token bridge: a session's ids are the tokens the engine sampled, joined by the chat
template's rendering of what the agent added in between.

A segment starts from the template's rendering of a request's messages (its prompt; the
tools passed to the template). Each answer appends the engine's output ids as they came (loss
mask 1, the engine's logprobs). The next request extends the segment when its messages begin
with everything the segment has seen (the requests' messages and the assistant messages as
returned) and add only non-assistant messages: the next context is then the previous context
+ the output ids + the template's rendering of the new messages after the model's turn
(`searchr1.chat_template.ToolTurns.messages_text`: the end of the model's turn when it was cut
before its end-of-turn token, the new messages, the next assistant header), tokenized once,
loss mask 0. The policy's own ids are never decoded and encoded again.

Any other request (an edited history, other tools, another temperature) starts a new segment:
never merged into an old one, never re-tokenized into it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.openai_api import ChatReply
from searchr1.chat_template import ToolTurns, prompt_token_ids


@dataclass
class ModelCall:
    """One model call of a segment."""

    index: int  # the call's index in its session (all segments)
    bridge_tokens: int  # template tokens appended before this call (mask 0)
    generated_tokens: int
    latency_s: float
    finish_reason: str  # the engine's
    weight_version: int  # of the call's first token
    cached_tokens: int
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments JSON)
    error: str = ""  # a malformed tool call
    reward: float = 0.0


@dataclass
class Segment:
    """One trajectory: a prompt and every turn that extended it."""

    index: int
    reason: str  # why it started: "start", or the fork reason
    prompt_ids: list[int]
    tools_key: str
    temperature: float
    seen: list[str]  # message keys: every request's messages and the answers as returned
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    has_logprobs: bool = True
    turns: list[ModelCall] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    last_text: str = ""  # the last output, decoded (does it end with the end-of-turn token?)
    last_request: list[str] = field(default_factory=list)  # message keys of the last request
    last_reply: ChatReply | None = None
    created_at: float = field(default_factory=time.time)
    finished_at: float = 0.0
    generate_s: float = 0.0

    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def model_ids(self) -> list[list[int]]:
        """Each turn's output ids as the engine sampled them (the template's ids between
        turns left out)."""
        out, at = [], 0
        for t in self.turns:
            at += t.bridge_tokens
            out.append(self.response_ids[at : at + t.generated_tokens])
            at += t.generated_tokens
        return out

    def append_bridge(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def append_output(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        if logprobs is None or len(logprobs) != len(ids):
            self.has_logprobs = False
            self.logprobs += [0.0] * len(ids)
        else:
            self.logprobs += [float(x) for x in logprobs]


@dataclass(frozen=True)
class Extend:
    """The request continues `segment`: `new` are its messages after what it has seen."""

    segment: Segment
    new: list[dict[str, Any]]


@dataclass(frozen=True)
class Replay:
    """The request repeats `segment`'s last one: its answer again (a client's retry)."""

    segment: Segment


@dataclass(frozen=True)
class Fork:
    """The request starts a new segment; `reason` is empty for a session's first."""

    reason: str


def match(
    segments: list[Segment],
    messages: list[dict[str, Any]],
    keys: list[str],
    tools_key: str,
    temperature: float,
) -> Extend | Replay | Fork:
    """Where a request goes in its session: the segment whose history it extends (the longest,
    so an agent may keep several conversations in one session), the last answer replayed, or
    a new segment (with the reason the latest segment could not be extended)."""
    best: Segment | None = None
    for seg in segments:
        same = seg.tools_key == tools_key and seg.temperature == temperature
        if same and keys == seg.last_request and seg.last_reply is not None:
            return Replay(seg)
        n = len(seg.seen)
        if not same or len(keys) <= n or keys[:n] != seg.seen:
            continue
        if any(m["role"] == "assistant" for m in messages[n:]):
            continue
        if best is None or n > len(best.seen):
            best = seg
    if best is not None:
        return Extend(best, messages[len(best.seen) :])
    if not segments:
        return Fork("")
    last = segments[-1]
    if last.tools_key != tools_key:
        return Fork("tools_changed")
    if last.temperature != temperature:
        return Fork("temperature_changed")
    n = len(last.seen)
    if len(keys) > n and keys[:n] == last.seen:
        return Fork("assistant_added")
    return Fork("edited")


class Renderer:
    """The served model's tokenizer and chat template: prompts, the text between turns, and
    the decoding of the engine's ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._turns: dict[str, ToolTurns] = {}

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        return prompt_token_ids(self.tok, messages, tools=tools or None)

    def bridge(
        self,
        turn_text: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        tools_key: str,
    ) -> list[int]:
        """The ids after a model message `turn_text`: `messages` as the template renders them
        there, with the end of the model's turn and the next assistant header. ValueError when
        the template cannot append them token-exactly."""
        turns = self._turns.get(tools_key)
        if turns is None:
            turns = ToolTurns(self.tok, tools, role="user")
            if len(self._turns) > 256:
                self._turns.clear()
            self._turns[tools_key] = turns
        text = turns.messages_text(turn_text, messages, strict=True)
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))

    @property
    def end_of_turn(self) -> str:
        eos = getattr(self.tok, "eos_token", None)
        return eos if isinstance(eos, str) else ""

    def visible_text(
        self, ids: list[int], finish_reason: str, matched: Any, stops: list[str]
    ) -> str:
        """The text an OpenAI client gets: without the end-of-turn token the model stopped on,
        cut before the stop string it stopped on (the ids keep both)."""
        if finish_reason == "stop" and isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = self.decode(ids)
        eot = self.end_of_turn
        if eot and text.endswith(eot):
            text = text[: -len(eot)]
        if finish_reason == "stop" and not isinstance(matched, int):
            # The engine names the string it matched (SGLang, ours); the first one in the text
            # is where generation stopped either way.
            at = [text.find(s) for s in ([matched] if isinstance(matched, str) else stops)]
            at = [i for i in at if i >= 0]
            if at:
                text = text[: min(at)]
        return text
