"""A prefix cache for the reference engine: a radix tree of KV spans over token ids.

Why: a Search-R1 sample is several turns and each turn's prompt is the whole conversation so
far, and the samples of one GRPO group share their prompt. With this cache a prompt's longest
already-computed prefix is copied in instead of being prefilled again (SGLang's RadixCache,
without its paged memory pool: nodes own their K/V tensors).

- Each node holds a span of token ids and, per layer, the K/V of those tokens
  (`[heads, span, dim]`, as the model produced them at their absolute positions 0..n-1 of the
  sequence: RoPE is already applied, so a cached prefix is valid for any sequence that starts
  with the same ids, whatever padding surrounds it in a batch).
- The cache holds at most `budget` tokens. Inserting evicts least-recently-used leaves first
  (a shared prefix outlives the branches hanging off it); a leaf locked by a running request
  is never evicted, and what still does not fit is not stored (the budget is a hard bound).
- `flush()` drops everything (after a weight update every cached K/V is stale) and moves
  `generation` on: leases and K/V computed before it are recognised as stale by their owner.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Per layer (k, v), each [heads, n, dim]: one sequence's K/V, no batch dimension.
KVRow = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class _Node:
    ids: tuple[int, ...] = ()
    kv: KVRow = field(default_factory=list)
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)  # keyed by first token
    lock_ref: int = 0  # running requests whose prefix runs through this node
    last_access: int = 0


@dataclass
class Lease:
    """The lock a request holds on its cached prefix while it runs (`PrefixCache.lock`)."""

    node: _Node | None
    generation: int
    released: bool = False


@dataclass
class CacheStats:
    budget: int
    tokens: int  # stored now
    nodes: int
    locked_tokens: int  # stored tokens some running request holds
    lookups: int
    lookup_tokens: int  # tokens asked for by match()
    hit_tokens: int  # of those, found
    inserted_tokens: int
    evicted_tokens: int
    flushes: int


def _slice(kv: KVRow, start: int, end: int) -> KVRow:
    # A copy, not a view: a view would keep the whole source tensor (a batch's KV, or the
    # other half of a split node) alive after that part is gone.
    return [(k[:, start:end].clone(), v[:, start:end].clone()) for k, v in kv]


class PrefixCache:
    """Radix tree of K/V spans over token ids, bounded by `budget` tokens, LRU eviction."""

    def __init__(self, budget: int) -> None:
        if budget < 1:
            raise ValueError(f"prefix cache budget must be >= 1 token (got {budget})")
        self.budget = budget
        self.generation = 0
        self._clock = itertools.count(1)  # LRU order; a counter, so ties cannot happen
        self._lookups = self._lookup_tokens = self._hit_tokens = 0
        self._inserted = self._evicted = self._flushes = 0
        self._reset()

    def _reset(self) -> None:
        self._root = _Node()
        self._tokens = 0
        self._nodes = 0
        self._locked_tokens = 0

    # ---- lookup ----------------------------------------------------------------------------

    def _walk(self, ids: Sequence[int]) -> tuple[list[_Node], int, int]:
        """The nodes along `ids`' longest cached prefix: (path, matched tokens, tokens of the
        last node on the path that match; may be less than its span)."""
        node, path, n, last = self._root, [], 0, 0
        while n < len(ids):
            child = node.children.get(ids[n])
            if child is None:
                break
            span = child.ids
            k = 0
            while k < len(span) and n + k < len(ids) and span[k] == ids[n + k]:
                k += 1
            path.append(child)
            n, last = n + k, k
            if k < len(span):
                break
            node = child
        return path, n, last

    def _touch(self, path: list[_Node]) -> None:
        now = next(self._clock)
        for node in path:
            node.last_access = now

    def cached_length(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` are cached (a peek: no stats, no LRU touch)."""
        return self._walk(ids)[1]

    def match(self, ids: Sequence[int]) -> tuple[int, KVRow | None]:
        """The longest cached prefix of `ids`: (its length, its K/V per layer); (0, None): none."""
        path, n, last = self._walk(ids)
        self._lookups += 1
        self._lookup_tokens += len(ids)
        self._hit_tokens += n
        if n == 0:
            return 0, None
        self._touch(path)
        parts = [node.kv for node in path[:-1]] + [
            [(k[:, :last], v[:, :last]) for k, v in path[-1].kv]
        ]
        kv = [
            (torch.cat([p[layer][0] for p in parts], 1), torch.cat([p[layer][1] for p in parts], 1))
            for layer in range(len(parts[0]))
        ]
        return n, kv

    # ---- insert ----------------------------------------------------------------------------

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after `at` tokens; returns the new parent holding the first part."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.ids)
        head = _Node(
            ids=node.ids[:at],
            kv=_slice(node.kv, 0, at),
            parent=parent,
            lock_ref=node.lock_ref,  # whoever locked `node` locked its whole path
            last_access=node.last_access,
        )
        parent.children[head.ids[0]] = head
        node.ids, node.kv, node.parent = node.ids[at:], _slice(node.kv, at, len(node.ids)), head
        head.children[node.ids[0]] = node
        self._nodes += 1
        return head

    def insert(self, ids: Sequence[int], kv: KVRow) -> int:
        """Store the K/V of `ids` (`kv[layer]` is `[heads, len(ids), dim]`) that is not stored
        yet, within the budget. Returns the number of tokens newly stored."""
        assert all(k.shape[1] == v.shape[1] == len(ids) for k, v in kv), "kv and ids disagree"
        path, n, last = self._walk(ids)
        node = self._root
        if path:
            node = path[-1]
            if last < len(node.ids):  # the match ends inside this node: cut it there
                node = self._split(node, last)
                path[-1] = node
        self._touch(path)
        if n == len(ids):
            return 0
        # Room for the new tail; the path being extended must survive the eviction.
        self._lock_path(node)
        try:
            self._evict(self._tokens + len(ids) - n - self.budget)
        finally:
            self._unlock_path(node)
        end = min(len(ids), n + self.budget - self._tokens)
        if end <= n:
            return 0  # locked prefixes fill the budget
        leaf = _Node(
            ids=tuple(ids[n:end]), kv=_slice(kv, n, end), parent=node, last_access=next(self._clock)
        )
        node.children[leaf.ids[0]] = leaf
        self._nodes += 1
        self._tokens += end - n
        self._inserted += end - n
        return end - n

    def _evict(self, need: int) -> None:
        """Free at least `need` tokens (or all that can go), least recently used leaves first."""
        if need <= 0:
            return
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < need:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.ids[0]]
            node.parent = None
            freed += len(node.ids)
            self._nodes -= 1
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self._tokens -= freed
        self._evicted += freed

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    # ---- locks -----------------------------------------------------------------------------

    def _lock_path(self, node: _Node | None) -> None:
        while node is not None and node is not self._root:
            if node.lock_ref == 0:
                self._locked_tokens += len(node.ids)
            node.lock_ref += 1
            node = node.parent

    def _unlock_path(self, node: _Node | None) -> None:
        while node is not None and node is not self._root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0
            if node.lock_ref == 0:
                self._locked_tokens -= len(node.ids)
            node = node.parent

    def lock(self, ids: Sequence[int]) -> Lease:
        """Keep the nodes holding `ids`' cached prefix from eviction until `unlock`."""
        path, _, _ = self._walk(ids)
        node = path[-1] if path else None
        self._lock_path(node)
        return Lease(node=node, generation=self.generation)

    def unlock(self, lease: Lease) -> None:
        """Release a lease; twice, or after a flush (the tree it locked is gone), is a no-op."""
        if lease.released:
            return
        lease.released = True
        if lease.generation == self.generation:
            # Walking up from the node also reaches parents that a split put above it.
            self._unlock_path(lease.node)

    # ---- the rest --------------------------------------------------------------------------

    def flush(self) -> None:
        """Drop everything (the weights changed); outstanding leases become no-ops."""
        self.generation += 1
        self._flushes += 1
        self._reset()

    @property
    def stats(self) -> CacheStats:
        return CacheStats(
            budget=self.budget,
            tokens=self._tokens,
            nodes=self._nodes,
            locked_tokens=self._locked_tokens,
            lookups=self._lookups,
            lookup_tokens=self._lookup_tokens,
            hit_tokens=self._hit_tokens,
            inserted_tokens=self._inserted,
            evicted_tokens=self._evicted,
            flushes=self._flushes,
        )
