"""Objects named by dotted path (`pkg.module:attr`), the way extension points are named.

The registries (`stack.cli.COMMANDS`, `trainer.backends.registry`) and the orchestrator's hooks
name what they load this way: the module is imported only when the object is wanted, so an
optional dependency (megatron-core) or a heavy one (torch) loads only where it is used.
"""

from __future__ import annotations

import importlib
from typing import Any


def split_path(path: str) -> tuple[str, str]:
    """(module, attribute) of `pkg.module:attr` or `pkg.module.attr`; ValueError otherwise."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"{path!r} is not a dotted path like 'pkg.module:function'")
    return module, attr


def load_object(path: str) -> Any:
    """Import the module of `path` and return its attribute (`a.b` walks nested attributes).
    ImportError / AttributeError name what is missing."""
    module, attr = split_path(path)
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
