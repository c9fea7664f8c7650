"""When a request stops, and the answer it gets: SGLang's finish reasons and output text.

A request stops on a stop token or an end-of-sequence id (unless `ignore_eos`), on a stop
string in its output, at `max_new_tokens`, or at the context length. Its text is the decoded
output, cut before a matched stop string unless `no_stop_trim`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inference.requests import GenerateOutput, Request

Decode = Callable[..., str]  # the tokenizer's `decode(ids, skip_special_tokens=...)`


def finish_reason(
    req: Request, token: int, *, eos_ids: set[int], context_length: int, decode: Decode
) -> dict[str, Any] | None:
    """Why `req` stops after sampling `token` (its newest output token), or None."""
    p = req.params
    if token in p.stop_token_ids or (token in eos_ids and not p.ignore_eos):
        return {"type": "stop", "matched": token}
    if p.stop:
        # Only the tail can hold a new match (an older one would have stopped us already);
        # every token is at least one byte, so this window covers any stop string that
        # ends in the newest token, and each step costs O(1) instead of O(output).
        window = max(len(s.encode()) for s in p.stop) + 8
        tail = decode(req.output_ids[-window:], skip_special_tokens=False)
        for s in p.stop:
            if s in tail:
                return {"type": "stop", "matched": s}
    if len(req.output_ids) >= p.max_new_tokens:
        return {"type": "length", "length": len(req.output_ids)}
    if len(req.input_ids) + len(req.output_ids) >= context_length:
        return {"type": "length", "length": len(req.output_ids)}
    return None


def final_output(
    req: Request, reason: dict[str, Any], *, decode: Decode, weight_version: int
) -> GenerateOutput:
    """What a stopped (or aborted) request answers."""
    p = req.params
    text = decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
    matched = reason.get("matched")
    if isinstance(matched, str) and not p.no_stop_trim:
        text = text[: text.find(matched)] if matched in text else text
    return GenerateOutput(
        text=text,
        output_ids=list(req.output_ids),
        logprobs=list(req.logprobs),
        finish_reason=reason,
        prompt_tokens=len(req.input_ids),
        weight_version=weight_version,
        version_events=list(req.version_events),
        cached_tokens=req.cached_tokens,
    )
