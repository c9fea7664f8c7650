"""Stand-in for `sgl_kernel` (PyPI `sglang-kernel`), so that a CPU-only sglang 0.5.21 can start.

The real package is a CUDA build that cannot be installed on a machine without a GPU. On CPU
(`SGLANG_USE_CPU_ENGINE=1 --device cpu`) sglang imports the seven names below at module level
(`if _is_cpu: from sgl_kernel import ...`), but calls them only on paths this project never takes
(speculative decoding, KV-cache moves between pools). Each name is a function that raises
NotImplementedError, so reaching one of those paths fails loudly instead of silently.

Test-support only: never install this next to a real `sgl_kernel`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

__all__ = [
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]


def _missing(name: str) -> Callable[..., NoReturn]:
    def stub(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this sgl_kernel is the CPU test stub from "
            "tests/support/sglang_cpu: the real CUDA kernel is not installed here"
        )

    stub.__name__ = stub.__qualname__ = name
    return stub


assign_extend_cache_locs_cpu = _missing("assign_extend_cache_locs_cpu")
assign_req_to_token_pool_cpu = _missing("assign_req_to_token_pool_cpu")
build_tree_kernel_efficient_cpu = _missing("build_tree_kernel_efficient_cpu")
copy_all_layer_kv_cache_cpu = _missing("copy_all_layer_kv_cache_cpu")
fill_accept_out_cache_loc_cpu = _missing("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _missing("fill_bonus_tokens_cpu")
verify_tree_greedy_cpu = _missing("verify_tree_greedy_cpu")
