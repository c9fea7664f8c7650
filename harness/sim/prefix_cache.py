"""One simulated engine's prefix cache: least recently used blocks of token ids.

A block is `block` ids keyed by a hash chained over every id before it, so a block hits only
when its whole prefix does, as in SGLang's radix cache. A lookup touches the blocks it matched
deepest first, so the root of a shared prefix is the most recent and leaves are evicted before
the prefixes they hang on (the radix cache evicts leaves). Capacity is in ids; the engine sets
it from its memory (`EngineCost.prefix_cache_tokens`, else the KV pool its running requests do
not hold).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SimulatedPrefixCache:
    def __init__(self, capacity: int, block: int = 16) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.capacity = max(int(capacity), 0)
        self.block = block
        self._blocks: OrderedDict[int, None] = OrderedDict()

    @property
    def size(self) -> int:
        """Ids held."""
        return len(self._blocks) * self.block

    def _keys(self, ids: Sequence[int]) -> list[int]:
        keys, h = [], 0
        for i in range(0, len(ids) - self.block + 1, self.block):
            h = hash((h, tuple(ids[i : i + self.block])))
            keys.append(h)
        return keys

    def _touch(self, keys: list[int]) -> None:
        for k in reversed(keys):  # the deepest first: the root ends the most recent
            self._blocks[k] = None
            self._blocks.move_to_end(k)

    def match(self, ids: Sequence[int]) -> int:
        """Ids of the longest cached prefix of `ids` (whole blocks); touches what it matched."""
        hit = []
        for k in self._keys(ids):
            if k not in self._blocks:
                break
            hit.append(k)
        self._touch(hit)
        return len(hit) * self.block

    def insert(self, ids: Sequence[int]) -> None:
        """Caches every whole block of `ids`, evicting the least recently used past capacity."""
        if self.capacity < self.block:
            return
        self._touch(self._keys(ids)[: self.capacity // self.block])
        self.shrink(self.capacity)

    def shrink(self, capacity: int) -> None:
        """Evicts the least recently used blocks until at most `capacity` ids are held."""
        while self._blocks and self.size > max(capacity, 0):
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
