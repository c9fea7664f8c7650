"""The receiving side of a hand-over (`/update_weights_from_tensor` on our engine): weights handed
over in memory by a `handover.HandoverSender`, copied into the model a `receiver.WeightLoader`
holds (the broadcast's receiver; the two share its update session).

The body is SGLang's (`serialized_named_tensors`, `load_format`, `flush_cache`,
`abort_all_requests`, `weight_version`), but the tensors arrive in our described format
(`searchr1.weightsync.handover`, `load_format="searchr1_handles"`): we never unpickle data from
the network, so SGLang's own pickled format (load_format None, "direct", "flattened_bucket", ...)
is refused with a 400 naming `load_format`.

As in SGLang 0.5.21 the call must come inside a weight-update session (`/begin_weight_update` ..
`/end_weight_update`); the version it carries is served from the session's end. Unlike the
distributed path (staged, applied at the end), a handed-over bucket is copied straight into the
parameters: staging would double the weight memory that colocation exists to save. Each call is
checked whole before anything is copied (names, shapes, bounds), so a refused call changes
nothing; but when a later bucket of a session is refused after earlier ones were copied, the
model is a mix, and generation answers 503 until a complete update lands.

A delta hand-over (`Handover.delta`) is decoded straight into the parameters too
(`delta.apply_in_place`), after the same whole-call checks plus the base state; a payload that
turns out corrupt midway, or a result that fails the sender's checksum at the session's end,
leaves a mix: 503 until a complete update lands (the sender resends in full at once).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from searchr1.weightsync.delta import EncodedTensor, Encoding, apply_in_place
from searchr1.weightsync.handover import LOAD_FORMAT, Handover, opened
from searchr1.weightsync.protocol import Bucket
from searchr1.weightsync.receiver import PLAIN, WEIGHT_UPDATES, UpdateSession, WeightLoader

log = logging.getLogger(__name__)


for _outcome in ("ok", "rejected"):  # at 0 from start-up
    WEIGHT_UPDATES.labels("tensor", _outcome)


def parse_handover(serialized: list[str], load_format: str | None) -> Handover:
    """The one rank's description; ValueError naming the field otherwise (counted)."""
    try:
        return _parse(serialized, load_format)
    except ValueError:
        WEIGHT_UPDATES.labels("tensor", "rejected").inc()
        raise


def _parse(serialized: list[str], load_format: str | None) -> Handover:
    if load_format != LOAD_FORMAT:
        raise ValueError(
            f"load_format {load_format!r} is not accepted: this engine never unpickles data from "
            f"the network (SGLang's serialized tensors are pickles); send load_format="
            f"{LOAD_FORMAT!r} (searchr1.weightsync.handover.HandoverSender)"
        )
    if len(serialized) != 1:
        raise ValueError(
            f"serialized_named_tensors: {len(serialized)} entries; this engine has one rank, "
            "send exactly one"
        )
    try:
        return Handover.model_validate_json(serialized[0])
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        problem = f"serialized_named_tensors[0]: not a {LOAD_FORMAT} description: {e}"
        raise ValueError(problem) from None


class WeightsHealth(Protocol):
    """What the engine says of its weights (`inference.memory.MemoryState` on ours)."""

    awaiting_weights: bool  # resumed without content: no delta applies

    def require_weights(self, what: str) -> None:
        """Raise when `what` cannot run on the weights as they are (released)."""
        ...

    def weights_broken(self) -> None:
        """The weights are a mix of two versions: refuse generation until an update lands."""
        ...


class HandoverReceiver:
    """Applies handed-over buckets into the model, inside the loader's open session."""

    def __init__(self, weights: WeightLoader, memory: WeightsHealth) -> None:
        self.weights = weights
        self.memory = memory
        self._session: object | None = None  # the session the count below belongs to
        self._applied = 0  # buckets copied in during that session
        weights.on_inconsistent = memory.weights_broken
        weights.content_known = lambda: not memory.awaiting_weights

    def apply(self, handover: Handover) -> int:
        """Copy one bucket in; returns the tensors applied. ValueError: refused, nothing
        copied from this call."""
        self.memory.require_weights("update_weights_from_tensor")
        session = self.weights.session
        if session is None:
            WEIGHT_UPDATES.labels("tensor", "rejected").inc()
            raise ValueError(  # SGLang 0.5.21's words
                "update_weights_from_tensor must run between begin_weight_update() and "
                "end_weight_update()"
            )
        if self._session is not session:
            self._session, self._applied = session, 0
        written = [False]  # this call wrote into the parameters
        try:
            if handover.delta is None:
                params = self.weights.check(
                    {t.name: (tuple(t.shape), t.dtype) for t in handover.tensors}
                )
                with opened(handover) as tensors:
                    self.weights.state, session.state = None, PLAIN
                    written[0] = True
                    self.weights.apply(params, tensors)
                session.written.update(params[n].data_ptr() for n in tensors)
            else:
                self._apply_delta(handover, session, written)
        except ValueError as e:
            WEIGHT_UPDATES.labels("tensor", "rejected").inc()
            session.failure = session.failure or str(e)
            if self._applied or written[0]:
                self.memory.weights_broken()
                log.warning("a handed-over bucket was refused after weights were written")
            raise
        self._applied += 1
        WEIGHT_UPDATES.labels("tensor", "ok").inc()
        return len(handover.tensors)

    @torch.no_grad()
    def _apply_delta(self, handover: Handover, session: UpdateSession, written: list[bool]) -> None:
        """Decode each payload into its parameter, after checking the call whole."""
        header = handover.delta
        assert header is not None
        specs = handover.tensors
        bucket = Bucket(
            names=[t.name for t in specs],
            dtypes=[t.dtype for t in specs],
            shapes=[t.shape for t in specs],
            delta=header,
        )
        params = self.weights.check_delta(bucket, header, session.held)
        for t, encoding in zip(specs, header.encodings, strict=True):
            # In place, a delta decodes against the weights as they are: one onto a storage
            # written earlier in this session (tied weights sent twice) would be wrong.
            if encoding not in ("full", "alias") and params[t.name].data_ptr() in session.written:
                raise ValueError(f"{t.name}: a delta onto weights this update already wrote")
        with opened(handover) as payloads:
            for t, encoding in zip(specs, header.encodings, strict=True):
                p, payload = params[t.name].data, payloads[t.name]
                if encoding == "alias":
                    source = payload.cpu().numpy().tobytes().decode(errors="replace")
                    if source not in session.names:
                        raise ValueError(
                            f"{t.name}: alias of {source!r}, not earlier in this update"
                        )
                    self.weights.state, written[0] = None, True
                    p.copy_(params[source].data)
                elif encoding != "same":
                    data = payload if encoding == "full" else payload.cpu()
                    enc = EncodedTensor(Encoding(encoding), data, p.dtype, tuple(p.shape))
                    self.weights.state, written[0] = None, True
                    apply_in_place(p, enc, t.name, undo=False)  # no undo in place here
                if encoding != "same":
                    session.written.add(p.data_ptr())
                session.names.append(t.name)
        if session.state != PLAIN:
            session.state = header.state
        session.checksum = header.checksum or session.checksum
