"""A block cache kept at the granularity of contiguous runs, not blocks.

Block ids are prefix-chained, so a cache that can only hit contiguously from the root is a tree of
runs: each node is a slice ``chain[s:e]`` of some request's id array, its children continue it.
Agent sessions are append-only, so a session is usually one node that grows at its tail. Eviction
takes the least recently used unpinned *leaf* and trims its tail, which is what vLLM's free-block
queue does (a finished request frees its blocks tail first; the queue head is the LRU). A trim is one
callback with the trimmed range, so the index sees one ``gpu_removed_hashes`` call per trim.

Every operation costs O(path length) plus O(log n) to find where a prompt diverges inside a node
(bisection works because ids are prefix-chained: equal at position j implies equal before j).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

# (chain, start, end): chain[start:end] left the cache
RemovedFn = Callable[[np.ndarray, int, int], None]



def first_mismatch(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray, lo: int, hi: int) -> int:
    """The first index in (lo, hi] where prefix-chained ``a`` and ``b`` differ, given that they
    agree at ``lo`` and differ at ``hi`` (chained ids: once they differ they stay different)."""
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if a[mid] == b[mid]:
            lo = mid
        else:
            hi = mid
    return hi

class Node:
    __slots__ = ("chain", "s", "e", "parent", "children", "ref", "last", "stamp", "alive")

    def __init__(self, chain: np.ndarray, s: int, e: int, parent: Node | None) -> None:
        self.chain = chain
        self.s = s
        self.e = e
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.ref = 0
        self.last = 0.0
        self.stamp = 0
        self.alive = True


class PrefixCache:
    """Run-granular LRU prefix cache with pinning and reservations (capacity in blocks)."""

    def __init__(self, capacity: float, on_removed: RemovedFn | None = None) -> None:
        self.capacity = capacity  # math.inf: never evicts
        self.on_removed = on_removed
        self.root = Node(np.empty(0, dtype=np.uint64), 0, 0, None)
        self.root.ref = 1  # never evicted
        self.used = 0  # blocks held in the tree
        self.reserved = 0  # blocks promised to admitted requests, not yet in the tree
        self.evicted = 0
        self._heap: list[tuple[float, int, int, Node]] = []
        self._seq = itertools.count()
        self._compact_at = 4096

    # ---- queries -------------------------------------------------------------------------------
    @property
    def free(self) -> float:
        return self.capacity - self.used - self.reserved

    def match(self, blocks: np.ndarray) -> tuple[Node, int]:
        """Deepest node on the prompt's path and the number of leading blocks held."""
        node = self.root
        pos = 0
        n = len(blocks)
        while pos < n:
            child = node.children.get(int(blocks[pos]))
            if child is None:
                break
            end = min(child.e, n)
            if child.chain[end - 1] == blocks[end - 1]:
                node, pos = child, end
                if end < child.e:
                    break
                continue
            # Diverges inside the child: first mismatch in (pos, end-1] by bisection.
            return child, first_mismatch(child.chain, blocks, pos, end - 1)
        return node, pos

    def match_exact(self, blocks: np.ndarray) -> tuple[Node, int]:
        """Like ``match``, but a prompt that ends or diverges inside a run splits it there, so that
        pinning the returned path pins only the blocks the prompt uses (the rest stays evictable)."""
        node, pos = self.match(blocks)
        if node is not self.root and node.s < pos < node.e:
            node = self._split(node, pos)
        return node, pos

    # ---- pinning -------------------------------------------------------------------------------
    def pin(self, node: Node, now: float) -> None:
        while node is not None and node is not self.root:
            node.ref += 1
            node.last = now
            node.stamp += 1
            node = node.parent  # type: ignore[assignment]

    def unpin(self, node: Node, now: float) -> None:
        while node is not None and node is not self.root:
            node.ref -= 1
            node.last = now
            node.stamp += 1
            if node.ref == 0 and not node.children:
                self._push(node)
            node = node.parent  # type: ignore[assignment]

    def touch(self, node: Node, now: float) -> None:
        """Mark a path used (a hit) without pinning it."""
        first = True
        while node is not None and node is not self.root:
            node.last = now
            node.stamp += 1
            if first and node.ref == 0 and not node.children:
                self._push(node)
            first = False
            node = node.parent  # type: ignore[assignment]

    # ---- capacity -------------------------------------------------------------------------------
    def reserve(self, n: int) -> bool:
        """Promise ``n`` blocks, evicting unpinned runs if needed; False (nothing changed) if it
        cannot fit."""
        if not self.make_room(n):
            return False
        self.reserved += n
        return True

    def release(self, n: int) -> None:
        self.reserved -= n

    def make_room(self, n: float) -> bool:
        """Evict LRU unpinned tails until ``n`` blocks are free."""
        if self.free >= n:
            return True
        if math.isinf(self.capacity):
            return True
        heap = self._heap
        while self.free < n and heap:
            last, _, stamp, node = heapq.heappop(heap)
            if not node.alive or node.stamp != stamp or node.ref or node.children:
                continue
            k = int(min(node.e - node.s, math.ceil(n - self.free)))
            old_e = node.e
            node.e -= k
            self.used -= k
            self.evicted += k
            if self.on_removed is not None:
                self.on_removed(node.chain, node.e, old_e)
            if node.e == node.s:
                self._drop(node)
            else:
                node.stamp += 1
                self._push(node)
        return self.free >= n

    # ---- insertion ------------------------------------------------------------------------------
    def insert(self, blocks: np.ndarray, end: int, now: float) -> tuple[Node, int]:
        """Hold ``blocks[:end]``; returns (deepest node, first block that was new). Blocks already
        held are not counted twice. The caller makes room (or holds a reservation) beforehand."""
        node, pos = self.match(blocks[:end])
        if pos >= end:
            return node, pos
        if pos < node.e and node is not self.root:
            node = self._split(node, pos)
        if node is not self.root and not node.children and node.e == pos:
            # Append-only session: grow the run in place (its chain extends the old one).
            node.chain = blocks
            node.e = end
            node.stamp += 1
        else:
            child = Node(blocks, pos, end, node)
            node.children[int(blocks[pos])] = child
            node = child
        node.last = now
        self.used += end - pos
        if node.ref == 0:
            self._push(node)
        return node, pos

    def _split(self, node: Node, pos: int) -> Node:
        """Cut ``node`` at ``pos``: a new upper node takes [s, pos), ``node`` keeps [pos, e) (so
        references held to it, e.g. by pinned requests, stay valid). Returns the upper node."""
        parent = node.parent
        assert parent is not None
        upper = Node(node.chain, node.s, pos, parent)
        upper.ref = node.ref
        upper.last = node.last
        parent.children[int(node.chain[node.s])] = upper
        node.s = pos
        node.parent = upper
        upper.children[int(node.chain[pos])] = node
        return upper

    def _drop(self, node: Node) -> None:
        node.alive = False
        parent = node.parent
        if parent is None:
            return
        parent.children.pop(int(node.chain[node.s]), None)
        if parent is not self.root and not parent.children and parent.ref == 0:
            parent.stamp += 1
            self._push(parent)

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last, next(self._seq), node.stamp, node))
        if len(self._heap) > self._compact_at:
            # Pins and touches leave stale entries behind; drop them before the heap bloats.
            self.compact_heap()
            self._compact_at = max(4096, 4 * len(self._heap))

    def compact_heap(self) -> None:
        """Drop stale heap entries (the heap only ever grows between evictions otherwise)."""
        self._heap = [e for e in self._heap if e[3].alive and e[3].stamp == e[2]]
        heapq.heapify(self._heap)

    # ---- introspection -----------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        out: list[Node] = []
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def held_blocks(self) -> int:
        return sum(n.e - n.s for n in self.nodes())
