"""Sampling parameters (SGLang's field names) and the per-request sampler.

Logprobs follow SGLang's sampler (`srt/layers/sampler.py`, `Sampler.forward`): the chosen
token's logprob under the temperature-scaled distribution, `log_softmax(logits / T)` of the fp32
logits, before any top-k/top-p truncation (those only change which token is drawn). Greedy
requests (T below SGLang's 1e-6, which it turns into top_k 1 at temperature 1) get
`log_softmax(logits)`. A trainer recomputes the same quantity by dividing its logits by T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# SGLang's names. `seed` is not one (SGLang answers it with a 500): rejected here with a 400.
KNOWN_FIELDS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "no_stop_trim",
        "skip_special_tokens",
        "ignore_eos",
        "sampling_seed",
    }
)
# Accepted and ignored, so SGLang clients that send them keep working.
IGNORED_FIELDS = frozenset(
    {
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "spaces_between_special_tokens",
    }
)


# SGLang's `_SAMPLING_EPS`: a temperature below it means greedy decoding.
GREEDY_TEMPERATURE_EPS = 1e-6

# Limits on what one (unauthenticated) request may ask of the scheduler thread, which decodes
# the output tail and scans it for every stop string at every step.
MAX_STOP_STRINGS = 32  # SGLang 0.5.21's MAX_STOP_COUNT
MAX_STOP_CHARS = 256  # SGLang has none for stop strings (256 bytes for stop_regex)
MAX_STOP_TOKEN_IDS = 1024  # searched at every step; SGLang has no limit (it keeps a set)
# SGLang 0.5.21 (`SamplingParams.verify`); torch takes the same range (negatives wrap).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _int(d: dict[str, Any], name: str, default: int) -> int:
    """An integer field: JSON ints (or integral floats such as 4.0), never bools or strings."""
    v = d.get(name, default)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"sampling_params.{name} must be an integer (got {v!r})")
    return v


def _float(d: dict[str, Any], name: str, default: float) -> float:
    """A finite number: NaN and Infinity (which Python's json module reads) are refused."""
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"sampling_params.{name} must be a number (got {v!r})")
    if not math.isfinite(v):
        raise ValueError(f"sampling_params.{name} must be finite (got {v!r})")
    return float(v)


def _bool(d: dict[str, Any], name: str, default: bool) -> bool:
    v = d.get(name, default)
    if not isinstance(v, bool):  # bool("false") is True
        raise ValueError(f"sampling_params.{name} must be true or false (got {v!r})")
    return v


def check_text(name: str, text: str) -> None:
    """Refuse a lone surrogate ("\\ud800" in JSON): Python's json module accepts it, but it
    has no UTF-8 form, so tokenizers and the answer's encoding fail on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name}: not valid Unicode (a lone surrogate {text[e.start]!r} at {e.start})"
        ) from None


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a `sampling_params` JSON object; ValueError names any bad field."""
        d = dict(d or {})
        unknown = sorted(set(d) - KNOWN_FIELDS - IGNORED_FIELDS)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}")
        # Types are checked here, one field at a time, so that every error names its field;
        # `int(float("inf"))` used to raise OverflowError past the handler (HTTP 500).
        stop = d.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("sampling_params.stop must be a string or a list of strings")
        stop_ids = d.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
        ):
            raise ValueError("sampling_params.stop_token_ids must be a list of integers")
        p = cls(
            max_new_tokens=_int(d, "max_new_tokens", 128),
            temperature=_float(d, "temperature", 1.0),
            top_p=_float(d, "top_p", 1.0),
            top_k=_int(d, "top_k", -1),
            stop=list(stop),
            stop_token_ids=list(stop_ids),
            no_stop_trim=_bool(d, "no_stop_trim", False),
            skip_special_tokens=_bool(d, "skip_special_tokens", True),
            ignore_eos=_bool(d, "ignore_eos", False),
            seed=None if d.get("sampling_seed") is None else _int(d, "sampling_seed", 0),
        )
        p.validate()
        return p

    def validate(self) -> None:
        """Ranges and limits (also for callers that build SamplingParams directly)."""
        if self.max_new_tokens < 0:  # 0 is an empty answer, as in SGLang
            raise ValueError(
                f"sampling_params.max_new_tokens must be >= 0 (got {self.max_new_tokens})"
            )
        # NaN passes every comparison below and samples garbage: refused, as SGLang does.
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"sampling_params.temperature must be finite and >= 0 (got {self.temperature})"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling_params.top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 or >= 1 (got {self.top_k})")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(
                f"sampling_params.sampling_seed must be in [-2**63, 2**63 - 1] (got {self.seed})"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"sampling_params.stop: at most {MAX_STOP_STRINGS} stop strings "
                f"(got {len(self.stop)})"
            )
        for i, s in enumerate(self.stop):
            if s == "":
                raise ValueError(f"sampling_params.stop.{i}: empty stop string")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(
                    f"sampling_params.stop.{i}: at most {MAX_STOP_CHARS} characters (got {len(s)})"
                )
            check_text(f"sampling_params.stop.{i}", s)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"sampling_params.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids "
                f"(got {len(self.stop_token_ids)})"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def logprob_temperature(self) -> float:
        """The T of the returned logprobs: SGLang makes a near-zero temperature 1 (greedy)."""
        return 1.0 if self.temperature < GREEDY_TEMPERATURE_EPS else self.temperature


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request RNG: a request's samples do not depend on its batch neighbours."""
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Draw the next token from one row of logits; return (token, its logprob at T)."""
    tokens, logprobs = sample_batch(logits[None], [params], [generator])
    return tokens[0], logprobs[0]


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """One token per row of [B, V] logits, each row with its own parameters and RNG.

    Rows are independent: row i's draw uses only its logits, its parameters and one uniform
    number from its own generator (inverse-CDF sampling; `torch.multinomial` costs ~20x more
    per call on CPU and we call it for every request at every step).
    """
    logits = logits.float()
    lp_temps = [p.logprob_temperature for p in params]
    if all(t == 1.0 for t in lp_temps):
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        t = torch.tensor(lp_temps, dtype=logits.dtype, device=logits.device)
        logprobs = torch.log_softmax(logits / t[:, None], dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        dev = logits.device
        temps = torch.tensor([params[i].temperature for i in rows], dtype=logits.dtype, device=dev)
        # A new tensor: the raw logits stay untouched (greedy rows read them).
        scores = logits[torch.tensor(rows, device=dev)] / temps[:, None]
        for j, i in enumerate(rows):
            if params[i].top_k > 0 or params[i].top_p < 1.0:
                scores[j] = _truncate(scores[j], params[i].top_k, params[i].top_p)
        probs = torch.softmax(scores, dim=-1)
        cdf = probs.cumsum(-1)
        # The per-request generators live on the CPU: one number each, then moved over.
        u = torch.stack([torch.rand((), generator=generators[i]) for i in rows])
        u = u.to(device=dev, dtype=cdf.dtype)
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        # Rounding can push the draw past the last token with mass: take that token instead.
        last = probs.size(1) - 1 - torch.argmax((probs.flip(-1) > 0).int(), dim=-1)
        tokens[torch.tensor(rows, device=dev)] = torch.minimum(drawn, last)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def _truncate(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of one row of scores (-inf outside)."""
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        p = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop_sorted = (p.cumsum(-1) - p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores
