"""Engine side of weight updates (our reference engine's; SGLang has its own): from a
checkpoint directory or by broadcast from a trainer.

Every method runs on the engine's scheduler thread (between decode steps) except `init_group`.
A bad update (unknown names, wrong shapes) raises ValueError *before* any parameter changes, so
the engine keeps serving the old weights. In the distributed path the tensors are received
first in any case: the sender broadcasts them regardless, and skipping the receive would leave
the group out of step for the next update.

Distributed updates follow SGLang 0.5.21's session protocol: `begin_session`, then any number
of `receive` calls (one per bucket), then `end_session`. Unlike SGLang, which loads each bucket
as it arrives, received tensors are staged and become the model's weights together at the end,
and only if every bucket of the session was accepted: a push that fails midway leaves the old
weights whole, never a mix.

Delta updates (a `protocol.DeltaHeader` on the bucket, or a `delta.safetensors` directory on
disk) are refused unless the model holds the state the deltas were made against (`state`: named
by the update that made it; unknown after a start, a plain update or a failed one). Their
payloads are kept (compressed) until the end, then decoded straight into the weights (an XOR a
chunk at a time: no second copy of the model, unlike staging) and, with a checksum on the
update, compared with the sender's. A corrupt payload or a mismatch undoes the whole update (an
XOR by applying it again), is counted, and the sender resends everything in full. (Hand-overs
write in place as they come: `handover_receiver`.)
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import Counter

from searchr1.weightsync.delta import EncodedTensor, Encoding, Undo, apply_in_place, state_checksum
from searchr1.weightsync.group import destroy_weight_group, dtype_from_name, new_weight_group
from searchr1.weightsync.protocol import (
    CHECKSUM_MISMATCH,
    DELTA_FILE,
    DELTA_METADATA,
    STALE_BASE,
    Bucket,
    DeltaHeader,
    GroupJoin,
)

log = logging.getLogger(__name__)


class GroupAlreadyFreed(ValueError):
    """A destroy for a group this engine freed itself when a newer one joined: the answer is
    SGLang's "does not exist", but it is the expected end of every takeover, not a fault."""


WEIGHT_UPDATES = Counter(
    "searchr1_inference_weight_updates_total", "Weight updates", ["source", "outcome"]
)
CHECKSUM_MISMATCHES = Counter(
    "searchr1_inference_weight_checksum_mismatches_total",
    "Weight updates whose result did not match the sender's checksum (undone, except a "
    "hand-over's; the sender resends in full)",
)
PLAIN = "plain"  # a session with a bucket of plain tensors: its result is no named state


@dataclass
class UpdateSession:
    """Buckets received since `begin_session`, applied together by `end_session`."""

    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    failure: str | None = None  # the first rejected bucket: the session applies nothing
    state: str | None = None  # the delta state the updates make (`PLAIN`: none)
    checksum: str | None = None  # the sender's, of every tensor of the session
    names: list[str] = field(default_factory=list)  # delta updates: every tensor, in order
    # Delta parts received: (name, encoding, payload), decoded into the weights at the end.
    patches: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)
    written: set[int] = field(default_factory=set)  # hand-over: storages written in place
    held: str | None = None  # the state the weights were at when the session began


def _copy_back(target: torch.Tensor, old: torch.Tensor) -> None:
    target.copy_(old)


class WeightLoader:
    def __init__(self, model: torch.nn.Module, *, timeout_s: float = 600.0) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self.groups: dict[str, Any] = {}
        # Names of groups a newer join freed (bounded: one per takeover).
        self.superseded: deque[str] = deque(maxlen=64)
        self.session: UpdateSession | None = None
        self.state: str | None = None  # the delta state the weights are at (None: unknown)
        # Called when an update written in place fails its checksum (hand-over: the model is
        # then no known version; `handover_receiver` marks it broken).
        self.on_inconsistent: Callable[[], None] | None = None
        # False while the weights have no known content (released and resumed without a
        # backup, or broken by a failed update): no delta applies then.
        self.content_known: Callable[[], bool] = lambda: True

    def _held(self) -> str | None:
        return self.state if self.content_known() else None

    def _params(self) -> dict[str, torch.Tensor]:
        # state_dict keys are the checkpoint's names; tied weights appear under both names.
        return dict(self.model.state_dict(keep_vars=True))

    def check(self, named: dict[str, tuple[torch.Size, Any]]) -> dict[str, torch.Tensor]:
        """The model's tensors by name; ValueError for unknown names or wrong shapes."""
        params = self._params()
        unknown = sorted(set(named) - set(params))
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:5]}")
        wrong = [
            f"{n}: got {list(shape)}, model has {list(params[n].shape)}"
            for n, (shape, _) in named.items()
            if tuple(shape) != tuple(params[n].shape)
        ]
        if wrong:
            raise ValueError(f"shape mismatch: {'; '.join(wrong[:5])}")
        return params

    @torch.no_grad()
    def apply(self, params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            p = params[name]
            p.data.copy_(t.to(device=p.device, dtype=p.dtype))

    def load_from_disk(self, path: Path) -> None:
        from safetensors import safe_open

        if (path / DELTA_FILE).is_file():
            return self._load_delta(path / DELTA_FILE)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            WEIGHT_UPDATES.labels("disk", "rejected").inc()
            raise ValueError(f"model_path {path}: no *.safetensors files in that directory")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[name] = sf.get_tensor(name)
        try:
            params = self.check({n: (t.shape, t.dtype) for n, t in tensors.items()})
        except ValueError:
            WEIGHT_UPDATES.labels("disk", "rejected").inc()
            raise
        self.apply(params, tensors)
        self.state = None
        WEIGHT_UPDATES.labels("disk", "ok").inc()
        log.info("weights loaded from disk", extra={"path": str(path), "tensors": len(tensors)})

    def _load_delta(self, file: Path) -> None:
        """A delta directory: decoded against the weights held, checked, applied whole."""
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as sf:
                meta = (sf.metadata() or {}).get(DELTA_METADATA)
                if meta is None:
                    raise ValueError(f"{file}: no {DELTA_METADATA} metadata")
                bucket = Bucket.model_validate_json(meta)
                blob = sf.get_tensor("payload") if "payload" in sf.keys() else None  # noqa: SIM118
            if bucket.delta is None:
                raise ValueError(f"{file}: no delta header")
            blob = torch.empty(0, dtype=torch.uint8) if blob is None else blob
            session = UpdateSession()
            params = self.check_delta(bucket, bucket.delta, self._held())
            if blob.dtype != torch.uint8 or blob.numel() != sum(bucket.delta.nbytes):
                raise ValueError(f"{file}: payload is not {sum(bucket.delta.nbytes)} bytes")
            self._stage_delta(bucket, bucket.delta, blob, params, session)
            self.state = None  # until it is applied whole
            self._apply_patches(params, session)
        except ValueError:
            WEIGHT_UPDATES.labels("disk", "rejected").inc()
            raise
        self.state = session.state
        WEIGHT_UPDATES.labels("disk", "ok").inc()
        log.info(
            "weight delta loaded from disk",
            extra={"path": str(file.parent), "tensors": len(session.names), "bytes": blob.numel()},
        )

    def check_delta(
        self, bucket: Bucket, header: DeltaHeader, held: str | None
    ) -> dict[str, torch.Tensor]:
        """The model's tensors, if a delta part fits them: names, shapes and dtypes (bit
        patterns are compared as the engine holds them), and the base state (`held`: the
        weights' state before the update)."""
        n = len(bucket.names)
        if not n == len(bucket.dtypes) == len(bucket.shapes) == len(header.encodings):
            raise ValueError("names, dtypes, shapes and delta.encodings must have one entry each")
        declared = {
            nm: (torch.Size(sh), dtype_from_name(dt))
            for nm, dt, sh in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=True)
        }
        params = self.check(declared)
        wrong = [n for n, (_, dt) in declared.items() if params[n].dtype != dt]
        if wrong:
            raise ValueError(f"delta updates need the engine's dtype: {wrong[:5]}")
        needs_base = any(e in ("same", "xor_zstd", "sparse_zstd") for e in header.encodings)
        if needs_base and (held is None or header.base != held):
            raise ValueError(f"{STALE_BASE} ({header.base}; this engine holds {held})")
        return params

    def _stage_delta(
        self,
        bucket: Bucket,
        header: DeltaHeader,
        blob: torch.Tensor,
        params: dict[str, torch.Tensor],
        session: UpdateSession,
    ) -> None:
        """Keep one part's payloads for `_apply_patches` (nothing kept if one is refused)."""
        blob = blob.cpu()
        patches: list[tuple[str, str, torch.Tensor]] = []
        names: list[str] = []
        offset = 0
        for name, encoding, nbytes in zip(
            bucket.names, header.encodings, header.nbytes, strict=True
        ):
            payload = blob[offset : offset + nbytes]
            offset += nbytes
            p = params[name]
            if encoding == "alias":
                source = payload.numpy().tobytes().decode(errors="replace")
                if source not in session.names and source not in names:
                    raise ValueError(f"{name}: alias of {source!r}, not earlier in this update")
                if params[source].shape != p.shape or params[source].dtype != p.dtype:
                    raise ValueError(f"{name}: alias of {source!r}, another shape or dtype")
            elif encoding == "same" and nbytes:
                raise ValueError(f"{name}: a 'same' tensor carries {nbytes} bytes")
            elif encoding == "full" and nbytes != p.numel() * p.element_size():
                raise ValueError(f"{name}: {nbytes} bytes for {p.numel() * p.element_size()}")
            patches.append((name, encoding, payload))
            names.append(name)
        session.patches.extend(patches)
        session.names.extend(names)
        if session.state != PLAIN:
            session.state = header.state
        session.checksum = header.checksum or session.checksum

    @torch.no_grad()
    def _apply_patches(self, params: dict[str, torch.Tensor], session: UpdateSession) -> None:
        """Decode every kept payload straight into its parameter (an XOR a chunk at a time:
        no second copy of the weights), then check the sender's checksum. ValueError: a payload
        turned out corrupt, or the result is not the sender's: everything is undone first."""
        undos: list[Undo] = []
        try:
            for name, encoding, payload in session.patches:
                p = params[name].data
                if encoding == "alias":
                    source = params[payload.numpy().tobytes().decode()].data
                    if source.data_ptr() != p.data_ptr():  # tied here too: nothing to do
                        old = p.clone()
                        p.copy_(source)
                        undos.append(functools.partial(_copy_back, p, old))
                elif encoding != "same":
                    enc = EncodedTensor(Encoding(encoding), payload, p.dtype, tuple(p.shape))
                    undos.append(apply_in_place(p, enc, name, swap=True))
            self._verify(session, params)
        except ValueError:
            for undo in reversed(undos):
                undo()
            raise

    def _verify(self, session: UpdateSession, params: dict[str, torch.Tensor]) -> None:
        """ValueError (counted) when the session's result is not what the sender sent."""
        if session.checksum is None:
            return
        got = state_checksum((n, params[n]) for n in session.names)
        if got != session.checksum:
            CHECKSUM_MISMATCHES.inc()
            self.state = None
            log.error(
                "weight checksum mismatch after an update",
                extra={"expected": session.checksum, "got": got, "tensors": len(session.names)},
            )
            raise ValueError(f"{CHECKSUM_MISMATCH}: expected {session.checksum}, got {got}")

    def init_group(self, join: GroupJoin) -> None:
        group_name, rank_offset, world_size = join.group_name, join.rank_offset, join.world_size
        if not 1 <= rank_offset < world_size:
            raise ValueError(f"rank_offset {rank_offset} outside [1, world_size={world_size})")
        # A name is reused by a trainer that re-creates its group: free it before joining anew.
        old = self.groups.pop(group_name, None)
        if old is not None:
            destroy_weight_group(old)
        group = new_weight_group(
            backend=join.backend,
            master_address=join.master_address,
            master_port=join.master_port,
            world_size=world_size,
            rank=rank_offset,
            group_name=group_name,
            timeout_s=self.timeout_s,
        )
        # One trainer pushes at a time and names each connection's group afresh: the groups
        # of earlier connections are dead, and kept they would pile up (sockets, communicators).
        # Freed only once the new one is joined, so a failed join keeps a working group.
        for name, stale in self.groups.items():
            destroy_weight_group(stale)
            self.superseded.append(name)
        self.groups = {group_name: group}
        log.info("joined weight update group", extra={"group": group_name, "rank": rank_offset})

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None and group_name in self.superseded:
            # The sender frees its old groups once its new one is joined; this engine freed
            # them at that join already. SGLang's answer, but an expected one (logged quietly).
            raise GroupAlreadyFreed("The group to be destroyed does not exist.")
        if group is None:
            raise ValueError("The group to be destroyed does not exist.")  # SGLang's words
        destroy_weight_group(group)
        log.info("destroyed weight update group", extra={"group": group_name})

    def begin_session(self) -> None:
        if self.session is not None:
            raise ValueError(
                "a weight-update session is already open; call end_weight_update() first"
            )
        self.session = UpdateSession(held=self._held())

    def end_session(self) -> int:
        """Apply every staged tensor (all or nothing); returns how many were applied."""
        session, self.session = self.session, None
        if session is None:
            raise ValueError("no weight-update session is open; call begin_weight_update() first")
        if session.failure is not None:
            WEIGHT_UPDATES.labels("distributed", "discarded").inc()
            raise ValueError(
                f"nothing applied: a bucket of this session was rejected ({session.failure})"
            )
        params = self._params()
        if session.written:  # hand-over: written in place already, checked now
            try:
                self._verify(session, params)
            except ValueError:
                if self.on_inconsistent is not None:
                    self.on_inconsistent()  # no version is served whole
                raise
        elif session.patches:
            try:
                self._apply_patches(params, session)
            except ValueError:
                WEIGHT_UPDATES.labels("distributed", "discarded").inc()
                raise
        self.apply(params, session.staged)
        if session.state is not None:  # any update at all: the weights are at its state
            self.state = None if session.state == PLAIN else session.state
        WEIGHT_UPDATES.labels("distributed", "ok").inc()
        return len(session.staged) + len(session.patches)

    def receive(self, bucket: Bucket) -> None:
        """Receive one bucket into the open session (staged, not yet applied)."""
        names, dtypes, shapes, group_name = (
            bucket.names,
            bucket.dtypes,
            bucket.shapes,
            bucket.group_name,
        )
        import torch.distributed as dist

        session = self.session
        if session is None:
            WEIGHT_UPDATES.labels("distributed", "rejected").inc()
            raise ValueError(
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()"
            )
        group = self.groups.get(group_name)
        if group is None:
            WEIGHT_UPDATES.labels("distributed", "rejected").inc()
            raise ValueError(f"no weight update group {group_name!r}: call init first")
        if bucket.delta is not None:
            return self._receive_delta(bucket, bucket.delta, group, session)
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        device = next(self.model.parameters()).device
        declared = {
            n: (torch.Size(s), dtype_from_name(d))
            for n, d, s in zip(names, dtypes, shapes, strict=True)
        }
        try:
            self.check(declared)
            problem = None
        except ValueError as e:
            problem = e
        targets = {
            name: torch.empty(shape, dtype=dtype, device=device)
            for name, (shape, dtype) in declared.items()
        }
        # The broadcast is per tensor, in order (SGLang's wire protocol). Receive everything
        # even when rejecting: the sender broadcasts regardless.
        works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in targets.values()]
        for w in works:
            w.wait()
        if problem is not None:
            WEIGHT_UPDATES.labels("distributed", "rejected").inc()
            session.failure = session.failure or str(problem)
            raise problem
        session.staged.update(targets)
        session.state = PLAIN

    def _receive_delta(
        self, bucket: Bucket, header: DeltaHeader, group: Any, session: UpdateSession
    ) -> None:
        """One delta bucket: its payloads arrive as one uint8 broadcast (received even when
        refusing: the sender broadcasts regardless), then decode into the session."""
        import torch.distributed as dist

        problem: ValueError | None = None
        params: dict[str, torch.Tensor] = {}
        try:
            params = self.check_delta(bucket, header, session.held)
        except ValueError as e:
            problem = e
        device = next(self.model.parameters()).device
        blob = torch.empty(sum(header.nbytes), dtype=torch.uint8, device=device)
        if blob.numel():
            dist.broadcast(blob, src=0, group=group)
        if problem is None:
            try:
                self._stage_delta(bucket, header, blob, params, session)
            except ValueError as e:
                problem = e
        if problem is not None:
            WEIGHT_UPDATES.labels("distributed", "rejected").inc()
            session.failure = session.failure or str(problem)
            raise problem

    def close(self) -> None:
        for g in self.groups.values():
            destroy_weight_group(g)
        self.groups.clear()
