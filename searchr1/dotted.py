"""Objects named by dotted path (`pkg.module:attr`), the way extension points are named.

The module may also be a Python file (`/path/to/my_task.py:MyTask`): a task, reward function or
tool written outside any package loads with nothing on `PYTHONPATH`.

The registries (`stack.cli.COMMANDS`, `trainer.backends.registry`) and the orchestrator's hooks
name what they load this way: the module is imported only when the object is wanted, so an
optional dependency (megatron-core) or a heavy one (torch) loads only where it is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
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
    obj: Any = _file_module(module) if module.endswith(".py") else importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _file_module(file: str) -> ModuleType:
    """The module of a Python file, loaded once (registered under a name of its path, so the
    classes it defines can be found again, e.g. by dataclasses and pickling in tests)."""
    resolved = Path(file).expanduser().resolve()
    name = "searchr1_file_" + "".join(c if c.isalnum() else "_" for c in str(resolved))
    if name in sys.modules:
        return sys.modules[name]
    if not resolved.is_file():
        raise ImportError(f"no such file: {resolved}")
    spec = importlib.util.spec_from_file_location(name, resolved)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
