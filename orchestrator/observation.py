"""Observations of the search environment, as text and as token ids (the tags that call it:
orchestrator/formats/search_r1.py).

Text formats are the references' exactly (spec section 2): documents are rendered as
`Doc {i}(Title: {title}) {text}\\n` and wrapped as `"\\n\\n<information>" + docs.strip() +
"</information>\\n\\n"`. Observation text is tokenized exactly once, `add_special_tokens=False`,
and those ids are appended to the context: the policy's own ids are never re-tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

OBS_PREFIX = "\n\n<information>"
OBS_SUFFIX = "</information>\n\n"


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the orchestrator uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class Doc(Protocol):
    id: str
    contents: str


def format_docs(docs: Sequence[Doc]) -> str:
    """Title = first line of `contents` (quotes kept), text = the remaining lines."""
    out = []
    for i, doc in enumerate(docs, 1):
        title, _, text = doc.contents.partition("\n")
        out.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(out)


def observation_text(body: str) -> str:
    return OBS_PREFIX + body.strip() + OBS_SUFFIX


@dataclass(frozen=True)
class Observation:
    text: str
    ids: list[int]
    truncated: bool = False


def tokenize_observation(tok: Tokenizer, body: str, max_tokens: int | None) -> Observation:
    """Tokenize `<information>` + body once; truncate the body (never the tags) to the cap.

    Within the cap the whole string is tokenized in one call. Over it, prefix, body and suffix
    are tokenized separately and the body's ids are cut, so the closing tag survives; the text
    is rebuilt from the kept ids, so decode(ids) == text still holds.
    """
    text = observation_text(body)
    ids = tok.encode(text, add_special_tokens=False)
    if max_tokens is None or len(ids) <= max_tokens:
        return Observation(text, ids)
    pre = tok.encode(OBS_PREFIX, add_special_tokens=False)
    suf = tok.encode(OBS_SUFFIX, add_special_tokens=False)
    room = max(max_tokens - len(pre) - len(suf), 0)
    body_ids = tok.encode(body.strip(), add_special_tokens=False)[:room]
    body_text = tok.decode(body_ids, skip_special_tokens=False)
    # A cut inside a multi-byte character decodes to U+FFFD; drop the partial character.
    while body_ids and body_text.endswith("\ufffd"):
        body_ids = body_ids[:-1]
        body_text = tok.decode(body_ids, skip_special_tokens=False)
    return Observation(OBS_PREFIX + body_text + OBS_SUFFIX, pre + body_ids + suf, truncated=True)


def tokenize_message(tok: Tokenizer, text: str) -> Observation:
    """A fixed message (the invalid-action correction): tokenized once, never truncated."""
    return Observation(text, tok.encode(text, add_special_tokens=False))
