"""The sender's side of delta updates: what its engines hold, and each update encoded against it.

A `Baseline` keeps, per engine group, the weights last delivered (on the CPU, in the engines'
dtype: what their bit patterns are) and the name of that state. An update (`Update`) encodes
each tensor against it (`delta.encode`), keeps the new tensor as the next baseline, and names
its tensors' encodings in a `protocol.DeltaHeader`. Deltas go only to our engine
(`model_info()["engine"] == "torch"`), and only while every engine reports the version the
baseline was delivered as; otherwise the update goes in full (with a header all the same, so
the engines learn the new state). An engine that refuses a delta (it holds another state), or
whose weights after an update do not match the sender's checksum, gets everything again in full
at once (`RESYNCS`). The checksum rides on the last part of every `verify_every`-th update.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from prometheus_client import Counter

from searchr1.weightsync.delta import (
    ZSTD_LEVEL,
    Encoding,
    bits,
    combine_digests,
    encode,
    tensor_digest,
)
from searchr1.weightsync.group import dtype_name
from searchr1.weightsync.protocol import (
    CHECKSUM_MISMATCH,
    DELTA_FILE,
    DELTA_METADATA,
    STALE_BASE,
    Bucket,
    DeltaHeader,
)

log = logging.getLogger(__name__)

RESYNCS = Counter(
    "searchr1_weight_delta_resyncs_total",
    "Delta weight updates resent in full: an engine refused the delta (it holds another state) "
    "or its weights did not match the trainer's checksum after the update",
    ["reason"],
)
ENCODED_BYTES = Counter(
    "searchr1_weight_update_bytes_total",
    "Bytes of weights sent by delta-capable senders, by encoding",
    ["encoding"],
)
for _reason in ("checksum", "stale_base", "refused"):
    RESYNCS.labels(_reason)
for _encoding in (*Encoding, "alias"):
    ENCODED_BYTES.labels(str(_encoding))

_ALIAS_SAMPLE = 64  # elements compared to find tensors that may be equal (tied weights)


def resync_reason(error: BaseException) -> str:
    """The `RESYNCS` label for an engine's refusal of a delta update."""
    text = str(error)
    if CHECKSUM_MISMATCH in text:
        return "checksum"
    return "stale_base" if STALE_BASE in text else "refused"


def delta_capable(infos: Sequence[dict[str, Any]]) -> bool:
    """Every engine is ours (SGLang has no delta route: it gets plain tensors)."""
    return bool(infos) and all(i.get("engine") == "torch" for i in infos)


class Baseline:
    """The weights one engine group holds, as last delivered by this process."""

    def __init__(
        self,
        *,
        verify_every: int = 10,
        level: int = ZSTD_LEVEL,
        threads: int = 0,
        recycle: bool = True,
    ) -> None:
        """`recycle`: keep the previous buffers for the next update's cast and XOR (twice the
        weights in host memory; fresh buffers cost page faults: measured 5x the cast's time)."""
        if verify_every < 0:
            raise ValueError("verify_every must be >= 0 (0: never)")
        self.verify_every = verify_every
        self.level = level
        self.threads = threads
        self.recycle = recycle
        self.tensors: dict[str, torch.Tensor] = {}
        self.spare: dict[str, torch.Tensor] = {}  # recycled buffers, content meaningless
        self.state: str | None = None  # None: unknown (nothing delivered, or a failed update)
        self.version: int | None = None
        self.updates = 0  # delivered with a header (counts toward the checksum interval)
        self._verify_next = False

    def usable(self, versions: Sequence[int]) -> bool:
        """Deltas against this baseline reach engines that report `versions`."""
        return self.state is not None and all(v == self.version for v in versions)

    def invalidate(self) -> None:
        """The engines' weights are unknown (an update failed midway): the next one is full."""
        self.state = None

    def verify_next(self) -> None:
        """The next update carries the checksum, whatever the interval."""
        self._verify_next = True

    def begin(self, version: int, *, delta: bool) -> Update:
        due = self.verify_every > 0 and self.updates % self.verify_every == 0
        due, self._verify_next = due or self._verify_next, False
        return Update(self, version, delta=delta and self.state is not None, checksum=due)


class Update:
    """One update's encoder: `encode` each tensor in order, `header` per part, `commit` once
    every engine took it. The baseline holds each tensor as soon as it is encoded, so it is
    invalidated until `commit`."""

    def __init__(self, baseline: Baseline, version: int, *, delta: bool, checksum: bool) -> None:
        self.baseline = baseline
        self.version = version
        self.delta = delta
        self.base = baseline.state if delta else None
        self.state = f"{version}-{secrets.token_hex(8)}"
        self.checksum_due = checksum
        self.digests: list[str] = []  # each tensor's, as encoded (where a checksum is due)
        self._samples: dict[tuple[Any, ...], list[str]] = {}
        self.raw_bytes = 0
        baseline.invalidate()

    def _alias(self, name: str, t: torch.Tensor) -> str | None:
        """An earlier tensor of this update with the same value (tied embeddings), if any."""
        flat = bits(t)
        step = max(1, flat.numel() // _ALIAS_SAMPLE)
        key = (t.dtype, tuple(t.shape), flat[::step][:_ALIAS_SAMPLE].numpy().tobytes())
        earlier = self._samples.setdefault(key, [])
        held = self.baseline.tensors
        match = next((n for n in earlier if torch.equal(bits(held[n]), flat)), None)
        if match is None:
            earlier.append(name)
        return match

    def _held(self, name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """`t` as the engines hold it, in a recycled buffer where one fits."""
        spare = self.baseline.spare.pop(name, None)
        want = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if spare is not None and spare.shape == t.shape and spare.dtype == want:
            return spare.copy_(t.detach())
        return engine_copy(t, dtype)

    def encode(
        self, name: str, t: torch.Tensor, dtype: torch.dtype | None
    ) -> tuple[torch.Tensor, str, torch.Tensor]:
        """(held, encoding, payload) for the trainer's `t`: `held` is `t` as the engines hold
        it (`dtype` for floating tensors, on the CPU), the next baseline."""
        held = self._held(name, t, dtype)
        self.raw_bytes += held.numel() * held.element_size()
        if self.checksum_due:
            self.digests.append(tensor_digest(name, held))
        alias = self._alias(name, held)
        prev = self.baseline.tensors.get(name)
        self.baseline.tensors[name] = held
        if prev is not None and self.baseline.recycle:
            self.baseline.spare[name] = prev  # after the XOR below, which is computed in it
        if alias is not None:
            payload = torch.frombuffer(bytearray(alias.encode()), dtype=torch.uint8)
            ENCODED_BYTES.labels("alias").inc(payload.numel())
            return held, "alias", payload
        enc = encode(
            prev if self.delta else None,
            held,
            level=self.baseline.level,
            threads=self.baseline.threads,
            consume_prev=True,
        )
        ENCODED_BYTES.labels(enc.encoding.value).inc(enc.nbytes)
        return held, enc.encoding.value, enc.payload

    def header(self, encodings: list[str], nbytes: list[int], *, last: bool) -> DeltaHeader:
        checksum = combine_digests(self.digests) if last and self.checksum_due else None
        return DeltaHeader(
            encodings=encodings, nbytes=nbytes, base=self.base, state=self.state, checksum=checksum
        )

    def commit(self) -> None:
        self.baseline.state, self.baseline.version = self.state, self.version
        self.baseline.updates += 1


def engine_copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` as the engines hold it (their dtype for floating tensors), on the CPU, in memory of
    its own (a baseline must not change when the trainer updates its parameters in place)."""
    src = t.detach()
    out = src.to(dtype) if dtype is not None and src.is_floating_point() else src
    out = out.to("cpu").contiguous()
    if out.data_ptr() == src.data_ptr():
        out = out.clone()
    return out


def log_resync(error: BaseException, engines: Sequence[str]) -> None:
    reason = resync_reason(error)
    RESYNCS.labels(reason).inc()
    log.warning(
        "delta weight update refused; resending in full",
        extra={"reason": reason, "engines": list(engines), "error": str(error)[:500]},
    )


def write_delta_dir(
    out_dir: Path,
    named: Iterable[tuple[str, torch.Tensor]],
    update: Update,
    dtype: torch.dtype | None,
) -> int:
    """An update on disk for `/update_weights_from_disk` (our engine: `protocol.DELTA_FILE`);
    returns the payload bytes. Written under a temporary name, then renamed."""
    from safetensors.torch import save_file

    bucket = Bucket(names=[], dtypes=[], shapes=[])
    encodings, payloads = [], []
    for name, t in named:
        held, encoding, payload = update.encode(name, t, dtype)
        bucket.names.append(name)
        bucket.dtypes.append(dtype_name(held.dtype))
        bucket.shapes.append(list(held.shape))
        encodings.append(encoding)
        payloads.append(payload)
    bucket.delta = update.header(encodings, [p.numel() for p in payloads], last=True)
    blob = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8)
    out_dir.mkdir(parents=True, exist_ok=True)
    part = out_dir / f".{DELTA_FILE}.part"
    save_file({"payload": blob}, str(part), metadata={DELTA_METADATA: bucket.model_dump_json()})
    part.replace(out_dir / DELTA_FILE)
    return int(blob.numel())
