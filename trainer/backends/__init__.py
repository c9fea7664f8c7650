"""The trainer's model-parallel backends (implementations of `trainer.backend.TrainerBackend`).

`registry` names each one's loader by dotted path, so the config can check `trainer.backend`
and the wiring can load the chosen one without importing the others: `hf` (Hugging Face, one
process or FSDP2) and `megatron` (Megatron-Core, TP x PP x DP; the `megatron` extra).
"""
