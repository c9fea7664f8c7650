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
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import Counter

from searchr1.weightsync.group import destroy_weight_group, dtype_from_name, new_weight_group
from searchr1.weightsync.protocol import Bucket, GroupJoin

log = logging.getLogger(__name__)


class GroupAlreadyFreed(ValueError):
    """A destroy for a group this engine freed itself when a newer one joined: the answer is
    SGLang's "does not exist", but it is the expected end of every takeover, not a fault."""


WEIGHT_UPDATES = Counter(
    "searchr1_inference_weight_updates_total", "Weight updates", ["source", "outcome"]
)


@dataclass
class UpdateSession:
    """Buckets received since `begin_session`, applied together by `end_session`."""

    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    failure: str | None = None  # the first rejected bucket: the session applies nothing


class WeightLoader:
    def __init__(self, model: torch.nn.Module, *, timeout_s: float = 600.0) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self.groups: dict[str, Any] = {}
        # Names of groups a newer join freed (bounded: one per takeover).
        self.superseded: deque[str] = deque(maxlen=64)
        self.session: UpdateSession | None = None

    def _params(self) -> dict[str, torch.Tensor]:
        # state_dict keys are the checkpoint's names; tied weights appear under both names.
        return dict(self.model.state_dict(keep_vars=True))

    def _check(self, named: dict[str, tuple[torch.Size, Any]]) -> dict[str, torch.Tensor]:
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
    def _apply(self, params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            p = params[name]
            p.data.copy_(t.to(device=p.device, dtype=p.dtype))

    def load_from_disk(self, path: Path) -> None:
        from safetensors import safe_open

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
            params = self._check({n: (t.shape, t.dtype) for n, t in tensors.items()})
        except ValueError:
            WEIGHT_UPDATES.labels("disk", "rejected").inc()
            raise
        self._apply(params, tensors)
        WEIGHT_UPDATES.labels("disk", "ok").inc()
        log.info("weights loaded from disk", extra={"path": str(path), "tensors": len(tensors)})

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
        self.session = UpdateSession()

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
        self._apply(self._params(), session.staged)
        WEIGHT_UPDATES.labels("distributed", "ok").inc()
        return len(session.staged)

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
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        device = next(self.model.parameters()).device
        declared = {
            n: (torch.Size(s), dtype_from_name(d))
            for n, d, s in zip(names, dtypes, shapes, strict=True)
        }
        try:
            self._check(declared)
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

    def close(self) -> None:
        for g in self.groups.values():
            destroy_weight_group(g)
        self.groups.clear()
