"""Extension points loaded by dotted path, resolved and signature-checked once at start-up.

A typo or a wrong signature fails when the service starts, naming the config field, not hours
later in the middle of a run (slime resolves its hooks lazily).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from searchr1.dotted import load_object, split_path


class HookError(ValueError):
    """A dotted-path hook that cannot be loaded or has the wrong signature."""


def load_hook(path: str, *, field: str, n_args: int, is_async: bool | None = None) -> Callable:
    """Import `pkg.mod:fn` (or `pkg.mod.fn`) and check it accepts exactly `n_args` positionals.

    `is_async`: True requires a coroutine function, False forbids one, None allows both.
    """
    try:
        module_name, attr = split_path(path)
    except ValueError as e:
        raise HookError(f"{field}: {e}") from None
    try:
        fn = load_object(path)
    except ImportError as e:
        raise HookError(f"{field}: cannot import module {module_name!r}: {e}") from e
    except AttributeError as e:
        raise HookError(f"{field}: module {module_name!r} has no {attr!r}") from e
    if not callable(fn):
        raise HookError(f"{field}: {path!r} is not callable")
    check_signature(fn, field=field, n_args=n_args)
    coro = inspect.iscoroutinefunction(fn)
    if is_async is True and not coro:
        raise HookError(f"{field}: {path!r} must be an `async def` function")
    if is_async is False and coro:
        raise HookError(f"{field}: {path!r} must be a plain (not async) function")
    return fn


def check_signature(fn: Callable, *, field: str, n_args: int) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise HookError(f"{field}: cannot inspect the signature of {fn!r}: {e}") from e
    try:
        sig.bind(*([None] * n_args))
    except TypeError as e:
        raise HookError(
            f"{field}: {getattr(fn, '__qualname__', fn)}{sig} must accept {n_args} positional "
            f"argument(s): {e}"
        ) from e
