"""A naive reference index and random trees, shared by the index tests."""

from __future__ import annotations


class Naive:
    """Per instance: held blocks (contiguous from the root), the fresh part of them, runs waiting
    for their parent, and pending routed prompts."""

    def __init__(self, parent):
        self.parent = parent
        self.held: dict[str, set[int]] = {}
        self.fresh: dict[str, set[int]] = {}
        self.waiting: dict[str, list[tuple[int, list[int]]]] = {}
        self.pending: dict[str, dict[int, float]] = {}  # inst -> last block -> deadline
        self.stale_until: dict[str, float] = {}  # inst -> when its stale entries are dropped

    def mark_stale(self, inst, now, ttl_s):
        self.fresh[inst] = set()
        self.stale_until[inst] = now + ttl_s

    def tick(self, now):
        """Stale entries not stored again since their instance was marked are dropped at the deadline."""
        for i, d in list(self.stale_until.items()):
            if d <= now:
                self.held[i] = set(self.fresh.get(i, set()))
                del self.stale_until[i]

    def clear(self, inst):
        self.held[inst], self.fresh[inst], self.waiting[inst], self.pending[inst] = set(), set(), [], {}
        self.stale_until.pop(inst, None)

    def store(self, inst, seg, now):
        held = self.held.setdefault(inst, set())
        fresh = self.fresh.setdefault(inst, set())
        first_parent = self.parent[seg[0]]
        if first_parent is not None and first_parent not in held:
            self.waiting.setdefault(inst, []).append((first_parent, seg))
            return
        held.update(seg)
        fresh.update(seg)
        x = first_parent
        while x is not None:  # storing under a block proves its whole prefix is there
            fresh.add(x)
            x = self.parent[x]
        for b in seg:
            self.pending.get(inst, {}).pop(b, None)
        for b in seg:  # runs waiting for one of these blocks
            ready = [w for w in self.waiting.get(inst, []) if w[0] == b]
            for w in ready:
                self.waiting[inst].remove(w)
                self.store(inst, w[1], now)

    def remove(self, inst, b):
        s = self.held.setdefault(inst, set())
        if b not in s:
            return
        todo = [b]
        while todo:  # descendants lose contiguity with the root
            x = todo.pop()
            if x in s:
                s.discard(x)
                self.fresh[inst].discard(x)
                todo.extend(k for k, p in self.parent.items() if p == x)

    def hit(self, inst, chain, which="held"):
        s = getattr(self, which).get(inst, set())
        n = 0
        for h in chain:
            if h not in s:
                break
            n += 1
        return n

    def local(self, inst, chain, now):
        best = self.hit(inst, chain)
        for last, deadline in self.pending.get(inst, {}).items():
            if deadline > now and last in chain:
                best = max(best, chain.index(last) + 1)
        return best

def random_tree(rng, n_nodes):
    parent = {1: None}
    for k in range(2, n_nodes + 1):
        parent[k] = rng.choice([None] + list(parent)) if rng.random() < 0.9 else None
    return parent

def path_to(parent, node):
    out = []
    while node is not None:
        out.append(node)
        node = parent[node]
    return out[::-1]
