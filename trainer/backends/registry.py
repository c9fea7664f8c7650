"""Which backend `trainer.backend` names: its loader, by dotted path (`module:function`).

A leaf (no imports): `trainer.config` checks the name against it without importing any
backend, and `trainer.wiring` imports only the chosen one, so megatron-core stays an optional
dependency. A loader takes `(TrainerConfig, DistInfo)` and returns a `TrainerBackend`.
"""

from __future__ import annotations

BACKENDS: dict[str, str] = {
    # Hugging Face causal LM, one process or FSDP2 over every rank.
    "hf": "trainer.backends.hf:load_hf_backend",
    # Megatron-Core GPTModel, TP x PP x DP (the `megatron` extra).
    "megatron": "trainer.backends.megatron.backend:load_megatron_backend",
}
