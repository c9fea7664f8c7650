"""The Megatron-Core trainer backend (`trainer.backend: megatron`); needs the `megatron` extra.

Modules: `config` (the `trainer.megatron` section), `model` (GPTModel from a Hugging Face
config), `convert` (HF <-> Megatron weights), `logprobs` (vocab-parallel logprobs/entropy),
`parallel` (process groups, attention masks), `weights` (load shards, gather for pushes),
`backend` (`MegatronBackend`), `checkpoint` (the gathered full state), `sharded`
(distributed checkpoints), `export`, `cpu` (CPU-only shims).
Only `config` is imported by the rest of the trainer; the others import megatron-core lazily.
"""
