"""`trainer.megatron`: the parallel layout of the Megatron backend (`trainer.backend: megatron`).

Checks that need the model or the world size (heads and query groups divisible by `tp`,
layers by `pp`, ranks by `tp * pp`) run when the backend starts: `check_layout`.
"""

from __future__ import annotations

from pydantic import Field

from searchr1.sections import Section


class MegatronConfig(Section):
    tp: int = Field(default=1, ge=1, description="Tensor-parallel size.")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel stages (layers split evenly).")
    distributed_optimizer: bool = Field(
        default=True, description="Shard the optimizer state over data-parallel ranks."
    )
    vocab_multiple: int = Field(
        default=128, ge=1, description="The vocabulary is padded to a multiple of this x tp."
    )


def check_layout(
    cfg: MegatronConfig, world_size: int, *, heads: int, kv_heads: int, layers: int
) -> int:
    """ValueError naming the first mismatch; returns the data-parallel size."""
    if world_size % (cfg.tp * cfg.pp):
        raise ValueError(
            f"world size {world_size} is not divisible by trainer.megatron.tp x pp "
            f"({cfg.tp} x {cfg.pp})"
        )
    if heads % cfg.tp or kv_heads % cfg.tp:
        raise ValueError(
            f"attention heads ({heads}) and key/value heads ({kv_heads}) must be divisible by "
            f"trainer.megatron.tp ({cfg.tp})"
        )
    if layers % cfg.pp:
        raise ValueError(f"layers ({layers}) must be divisible by trainer.megatron.pp ({cfg.pp})")
    return world_size // (cfg.tp * cfg.pp)
