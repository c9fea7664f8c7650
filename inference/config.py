"""Configuration of the inference service (its section of the stack config file)."""

from __future__ import annotations

from pydantic import Field

from searchr1.sections import HttpConfig, Section


class InferenceConfig(Section):
    http: HttpConfig = Field(default_factory=lambda: HttpConfig(port=30000))
