"""Clients of the inference engines: what the orchestrator, trainer and gateway use to reach them.

A package of its own so the engine (`inference/`) never imports its callers' side.
"""
