"""The HTTP contract of the weight routes, as both engines (SGLang and ours) answer them.

The bodies of `/init_weights_update_group`, `/destroy_weights_update_group` and
`/update_weights_from_distributed` (SGLang's field names), the dtype names on the wire, the
engine calls the sender drives (`WeightEngine`) and the error that means "the engine refused"
(`EngineRefused`). Light on purpose (pydantic only, no torch): the inference client imports it.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

# The dtype names a bucket may declare ("torch." prefixes are accepted too); `group.DTYPES`
# maps them to torch dtypes.
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")


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


class Bucket(BaseModel):
    """One broadcast of tensors: SGLang's `/update_weights_from_distributed` body. The tensors
    themselves follow over the group, one broadcast each, in this order."""

    model_config = ConfigDict(extra="ignore")

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None  # SGLang's versions are strings
    flush_cache: bool = True
    abort_all_requests: bool = False


class EngineRefused(Exception):
    """The engine answered and refused the call (a 4xx, or `{"success": false}`): retrying the
    same call would not help. A `WeightEngine` raises it (or a subclass) for a refusal."""


class WeightEngine(Protocol):
    """The calls a `WeightSender` drives on one engine (`inference.client.InferenceClient`)."""

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

    async def init_weights_update_group(self, join: GroupJoin) -> None: ...

    async def destroy_weights_update_group(self, group_name: str) -> bool:
        """False when the engine has no such group."""
        ...

    async def update_weights_from_distributed(self, bucket: Bucket) -> None: ...

    async def aclose(self) -> None: ...
