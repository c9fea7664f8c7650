"""Rollout generation: the SGLang HTTP protocol (SGLang on GPU, a reference engine on CPU)."""
