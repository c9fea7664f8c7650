"""Sampling parameters (SGLang's field names) and the per-request sampler.

Logprobs follow SGLang's sampler (`srt/layers/sampler.py`, `Sampler.forward`): the chosen
token's logprob under the temperature-scaled distribution, `log_softmax(logits / T)` of the fp32
logits, before any top-k/top-p truncation (those only change which token is drawn). Greedy
requests (T below SGLang's 1e-6, which it turns into top_k 1 at temperature 1) get
`log_softmax(logits)`. A trainer recomputes the same quantity by dividing its logits by T.
"""

from __future__ import annotations

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
        stop = d.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        seed = d.get("sampling_seed")
        try:
            p = cls(
                max_new_tokens=int(d.get("max_new_tokens", 128)),
                temperature=float(d.get("temperature", 1.0)),
                top_p=float(d.get("top_p", 1.0)),
                top_k=int(d.get("top_k", -1)),
                stop=[str(s) for s in stop],
                stop_token_ids=[int(t) for t in (d.get("stop_token_ids") or [])],
                no_stop_trim=bool(d.get("no_stop_trim", False)),
                skip_special_tokens=bool(d.get("skip_special_tokens", True)),
                ignore_eos=bool(d.get("ignore_eos", False)),
                seed=None if seed is None else int(seed),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"sampling_params: {e}") from None
        p.validate()
        return p

    def validate(self) -> None:
        if self.max_new_tokens < 0:  # 0 is an empty answer, as in SGLang
            raise ValueError(
                f"sampling_params.max_new_tokens must be >= 0 (got {self.max_new_tokens})"
            )
        if self.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling_params.top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 or >= 1 (got {self.top_k})")
        if any(s == "" for s in self.stop):
            raise ValueError("sampling_params.stop: empty stop string")

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
