"""The HTTP contract of the weight routes, as both engines (SGLang and ours) answer them.

The bodies of `/init_weights_update_group`, `/destroy_weights_update_group` and
`/update_weights_from_distributed` (SGLang's field names), the dtype names on the wire, the
per-tensor encodings of a delta update (`DeltaHeader`: our engine only), the engine calls the
sender drives (`WeightEngine`) and the error that means "the engine refused" (`EngineRefused`).
Light on purpose (pydantic only, no torch): the inference client imports it.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The dtype names a bucket may declare ("torch." prefixes are accepted too); `group.DTYPES`
# maps them to torch dtypes.
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")
# How a tensor of a delta update travels (`searchr1.weightsync.delta.Encoding`), plus `alias`:
# its payload is the UTF-8 name of an earlier tensor of the same update holding the same new
# value (tied embeddings go once).
ENCODING_NAMES = ("full", "same", "xor_zstd", "sparse_zstd", "alias")
# The engine's refusal of a delta whose base it does not hold, and of an update whose result
# does not match the sender's checksum: the sender resends everything in full.
STALE_BASE = "weight delta against a state this engine does not hold"
CHECKSUM_MISMATCH = "weight checksum mismatch"
# A delta update on disk: a directory with this one file: the payloads as one uint8 tensor
# "payload", and a `Bucket` with its `DeltaHeader` (JSON) under this metadata key.
DELTA_FILE = "delta.safetensors"
DELTA_METADATA = "searchr1.delta"


class GroupJoin(BaseModel):
    """How an engine joins a weight-update group: SGLang's `/init_weights_update_group` body,
    used by the sender, the HTTP route and the engine alike."""

    # SGLang ignores fields it does not use; so do we.
    model_config = ConfigDict(extra="ignore")

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int
    world_size: int = Field(ge=2)
    group_name: str = Field(default="weight_update_group", min_length=1, max_length=256)
    backend: Literal["nccl", "gloo"] = "nccl"


class GroupDestroy(BaseModel):
    """SGLang's `/destroy_weights_update_group` body."""

    model_config = ConfigDict(extra="ignore")

    group_name: str = Field(default="weight_update_group", min_length=1, max_length=256)


class DeltaHeader(BaseModel):
    """The encodings of one part of a delta update (a bucket, a hand-over, a delta directory):
    tensor i's payload is `nbytes[i]` bytes, the payloads back to back in one uint8 buffer.

    A sender that encodes against the weights it last delivered names that state (`base`,
    needed by every `same`/`xor_zstd`/`sparse_zstd`) and the one this update makes (`state`);
    the engine refuses a delta against a base it does not hold. `checksum`
    (`delta.state_checksum` of every tensor of the update, on its last part, at the sender's
    interval) is checked by the engine before the update takes effect."""

    model_config = ConfigDict(extra="forbid")

    encodings: list[Literal[ENCODING_NAMES]]  # type: ignore[valid-type]
    nbytes: list[int]
    base: str | None = Field(default=None, max_length=128)
    state: str = Field(min_length=1, max_length=128)
    checksum: str | None = Field(default=None, max_length=128)

    @model_validator(mode="after")
    def _lengths(self) -> DeltaHeader:
        if len(self.nbytes) != len(self.encodings) or min(self.nbytes, default=0) < 0:
            raise ValueError("nbytes needs one size >= 0 per encoding")
        return self


class Bucket(BaseModel):
    """One broadcast of tensors: SGLang's `/update_weights_from_distributed` body. The tensors
    themselves follow over the group, one broadcast each, in this order; with `delta` (ours
    only) they follow as ONE uint8 broadcast of `sum(delta.nbytes)` bytes (none if 0)."""

    model_config = ConfigDict(extra="ignore")

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None  # SGLang's versions are strings
    flush_cache: bool = True
    abort_all_requests: bool = False
    delta: DeltaHeader | None = None


class EngineRefused(Exception):
    """The engine answered and refused the call (a 4xx, or `{"success": false}`): retrying the
    same call would not help. A `WeightEngine` raises it (or a subclass) for a refusal."""


class SessionEngine(Protocol):
    """The calls both senders drive around a push (`session.update_session`)."""

    base_url: str

    async def get_model_info(self) -> dict[str, Any]:
        """Needs `weight_version` (an int) and, when known, `dtype` (a name above)."""
        ...

    async def pause_generation(self, mode: str = "abort") -> None: ...

    async def continue_generation(self) -> None: ...

    async def begin_weight_update(self) -> bool:
        """Open a session; False when the engine has none (older SGLang)."""
        ...

    async def end_weight_update(self) -> None: ...


class WeightEngine(SessionEngine, Protocol):
    """The calls a `WeightSender` drives on one engine (`engine_client.client.InferenceClient`)."""

    async def init_weights_update_group(self, join: GroupJoin) -> None: ...

    async def destroy_weights_update_group(self, group_name: str) -> bool:
        """False when the engine has no such group."""
        ...

    async def update_weights_from_distributed(self, bucket: Bucket) -> None: ...

    async def aclose(self) -> None: ...
