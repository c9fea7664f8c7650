"""The Megatron-Core trainer backend (`trainer.backend: megatron`); needs the `megatron` extra.

Modules: `config` (the `trainer.megatron` section), `model` (GPTModel from a Hugging Face
config), `convert` (HF <-> Megatron weights), `logprobs` (vocab-parallel logprobs/entropy),
`parallel` (process groups, attention masks), `weights` (load shards, gather for pushes),
`backend` (`MegatronBackend`), `checkpoint` (the gathered full state), `sharded`
(distributed checkpoints), `attention` (per-sequence attention), `cpu` (CPU-only shims).
The rest of the trainer imports only `config`; `backend` is loaded by its dotted path
(`trainer.backends.registry`) when chosen. Only `attention` imports megatron-core at module
top; the others import it inside the functions that need it.
"""
