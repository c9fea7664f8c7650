"""The rollout's per-turn encode/decode on the `tokenizers` (Rust) backend, called directly.

transformers' `encode`/`decode` on a fast tokenizer end in one call of its Rust backend, after
~30 us of Python per call (argument checks, padding/truncation set-up, a BatchEncoding built
and taken apart). The rollout decodes every turn and tokenizes every observation, so
`RustTokenizer` calls the backend itself and hands everything else (`apply_chat_template`,
`len`, special tokens...) to the wrapped tokenizer. Ids and text are the wrapped tokenizer's
exactly: the backend is a copy of the one transformers loaded (with whatever it rebuilt on
load), with no truncation or padding, and special tokens split as `split_special_tokens` says;
a tokenizer whose decode cleans up spaces (WordPiece-style) decodes through transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class RustTokenizer:
    def __init__(self, hf: Any) -> None:
        from tokenizers import Tokenizer

        self.hf = hf
        # A copy: transformers sets truncation/padding on its backend per call; ours has none.
        self.backend = Tokenizer.from_str(hf.backend_tokenizer.to_str())
        self.backend.no_truncation()
        self.backend.no_padding()
        self.backend.encode_special_tokens = bool(getattr(hf, "split_special_tokens", False))
        self._hf_decode = bool(getattr(hf, "clean_up_tokenization_spaces", False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The same ids as `encode`, without tracking offsets: ~15% less CPU.
        [enc] = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return enc.ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if self._hf_decode:
            return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return len(self.hf)

    def __getattr__(self, name: str) -> Any:
        if name == "hf":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.hf, name)


def rust_tokenizer(hf: Any) -> Any:
    """`RustTokenizer` over a transformers fast tokenizer; any other tokenizer as it is."""
    if getattr(hf, "backend_tokenizer", None) is None:
        return hf
    return RustTokenizer(hf)
