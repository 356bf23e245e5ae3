"""Prefix lookups over monotone holder masks, and their per-instance result."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from smetric_lmc.index.table import KeyIndex

Groups = list[tuple[int, int]]  # (slot mask, hit length): disjoint masks, one per distinct hit


class Lookup:
    """Result of a prefix lookup, kept as hit groups (slot mask, length) per tier.

    Per-instance lists (indexed like ``TierIndex.instances``) are built only when asked for; a
    route asks instead for the longest hit and its holders (:meth:`best`) and for one instance's
    hit (:meth:`at`), which cost O(distinct hit lengths + holders), not O(instances)."""

    __slots__ = ("global_chunks", "block_size", "chunk_size", "_gpu", "_fresh", "_lmc", "_pending", "_pos",
                 "_slots", "_n", "_all", "_local", "_best", "_src")

    def __init__(self, gpu: Groups, fresh: Groups | None, lmc: Groups, pending: list[tuple[int, int]],
                 global_chunks: int, block_size: int, chunk_size: int, pos: list[int], slots: list[int],
                 all_mask: int) -> None:
        self.global_chunks = global_chunks
        self.block_size = block_size
        self.chunk_size = chunk_size
        # fresh: the GPU groups over fresh entries only (None when no instance has stale entries);
        # pending: (slot, blocks) credits of routed prompts this one extends.
        self._gpu, self._fresh, self._lmc, self._pending = gpu, fresh, lmc, pending
        self._pos, self._slots, self._n, self._all = pos, slots, len(slots), all_mask
        self._local: list[int] | None = None
        self._best: tuple[int, list[int] | None] | None = None
        self._src: tuple[tuple[Groups, int], ...] | None = None

    def local_hit_tokens(self) -> list[int]:
        """Per instance: the longest of its GPU (+ pending) hit and its LMCache hit, in tokens."""
        if self._local is None:
            pos, n, bs = self._pos, self._n, self.block_size
            local = expand(self._gpu, bs, pos, n, self._all)
            for slot, length in self._pending:
                p = pos[slot]
                if p >= 0 and local[p] < length * bs:
                    local[p] = length * bs
            if self._lmc:
                local = [max(a, b) for a, b in zip(local, expand(self._lmc, self.chunk_size, pos, n, self._all))]
            self._local = local
        return self._local

    def _sources(self) -> tuple[tuple[Groups, int], ...]:
        """Every hit source with its token scale: GPU groups, pending credits, LMCache groups."""
        if self._src is None:
            pos = self._pos
            pending = [(1 << slot, length) for slot, length in self._pending if pos[slot] >= 0]
            self._src = (self._gpu, self.block_size), (pending, self.block_size), (self._lmc, self.chunk_size)
        return self._src

    def best(self) -> tuple[int, list[int] | None]:
        """(the longest local hit in tokens, positions of the instances holding it in instance
        order, or None when every instance does)."""
        if self._best is None:
            top = mask = 0
            for groups, scale in self._sources():
                for m, v in groups:
                    t = v * scale
                    if t > top:
                        top, mask = t, m
                    elif t == top:
                        mask |= m
            if top == 0 or mask == self._all:
                self._best = (top, None)
            else:
                self._best = (top, sorted(positions(mask, self._pos)))
        return self._best

    def at(self, p: int) -> int:
        """Instance ``p``'s local hit in tokens."""
        if self._local is not None:
            return self._local[p]
        bit = 1 << self._slots[p]
        top = 0
        for groups, scale in self._sources():
            for m, v in groups:
                if m & bit and v * scale > top:
                    top = v * scale
        return top

    def stale_hit_tokens(self) -> list[int]:
        """Per instance: how many of its GPU hit tokens come from entries marked stale (the hit's
        tail: a fresh store refreshes everything above it)."""
        if self._fresh is None:
            return [0] * self._n
        pos, n, a = self._pos, self._n, self._all
        return [(x - y) * self.block_size for x, y in zip(expand(self._gpu, 1, pos, n, a), expand(self._fresh, 1, pos, n, a))]

    @property
    def gpu_blocks(self) -> list[int]:
        return expand(self._gpu, 1, self._pos, self._n, self._all)

    @property
    def lmcache_chunks(self) -> list[int]:
        return expand(self._lmc, 1, self._pos, self._n, self._all)

    @property
    def global_hit_tokens(self) -> int:
        return self.global_chunks * self.chunk_size


def positions(mask: int, pos: list[int]) -> list[int]:
    """Instance positions of the slots in ``mask``, in bit order."""
    out = []
    while mask:
        low = mask & -mask
        out.append(pos[low.bit_length() - 1])
        mask ^= low
    return out


def bisect(chain: Sequence[int], rows: KeyIndex, mid: Sequence[int], view: Sequence[int],
           run: Sequence[int]) -> Groups:
    """Slots grouped by number of leading blocks held, given holder masks that only shrink along
    the chain. Each distinct mask is a run of positions; its end is first sought where the stored
    blocks say their run ends (``run``: blocks from a row to the end of the run stored with it,
    a few hops), then by binary search in what is left. O(distinct hit lengths x log n) probes at
    worst, a few per distinct hit when blocks were stored as they are looked up."""
    n = len(chain)
    if n == 0:
        return []
    rlo = rows.find(chain[0])
    cur = view[mid[rlo]]
    if not cur:
        return []
    r = rows.find(chain[n - 1])
    last = view[mid[r]]
    slots, keys, hmask = rows.slots, rows.keys, rows.mask
    groups: Groups = []
    lo = 0
    while cur != last:
        # mask(lo) == cur (row rlo), mask(hi) == mhi != cur: find where the run of ``cur`` ends
        hi, mhi, rhi = n - 1, last, r
        hops = 4
        while hi - lo > 1:
            if hops:  # the hinted end of the stored run, or the block after it when lo is that end
                hops -= 1
                m = lo + (run[rlo] - 1 or 1)
                if not lo < m < hi:
                    m, hops = (lo + hi) >> 1, 0
            else:
                m = (lo + hi) >> 1
            h = chain[m]  # KeyIndex.find, inlined: this is the route's hot loop
            i = h & hmask
            r = slots[i]
            while r and keys[r] != h:
                i += 1
                r = slots[i]
            mm = view[mid[r]]
            if mm == cur:
                lo, rlo = m, r
            else:
                hi, mhi, rhi, hops = m, mm, r, 0
        groups.append((cur & ~mhi, hi))  # slots that hold blocks 0..hi-1 but not block hi
        cur, lo, rlo = mhi, hi, rhi
        if not cur:
            return groups
    groups.append((cur, n))
    return groups


def walk(chain: Sequence[int], get: Callable[[int, int], int]) -> Groups:
    """Slots grouped by leading entries held, walking the chain (for spaces with holes)."""
    groups: Groups = []
    alive = get(chain[0], 0)
    if not alive:
        return groups
    for j in range(1, len(chain)):
        m = get(chain[j], 0) & alive
        if m != alive:
            groups.append((alive & ~m, j))
            alive = m
            if not alive:
                return groups
    groups.append((alive, len(chain)))
    return groups


def expand(groups: Groups, scale: int, pos: list[int], n: int, all_mask: int) -> list[int]:
    """Per-instance list from hit groups. Starts from the largest group's value so the Python-level
    work is proportional to the instances *outside* it (64 instances sharing a system prompt cost
    one list multiplication, not 64 stores)."""
    if not groups:
        return [0] * n
    if len(groups) == 1:
        big_mask, big_val = groups[0]
    else:
        big_mask, big_val = max(groups, key=lambda g: g[0].bit_count())
    if big_mask.bit_count() * 2 < n:  # sparse: most instances hit nothing
        out = [0] * n
        rest = groups
    else:
        out = [big_val * scale] * n
        covered = 0
        for m, _ in groups:
            covered |= m
        rest = [g for g in groups if g[0] != big_mask]
        missing = all_mask & ~covered
        if missing:
            rest.append((missing, 0))
    for mask, val in rest:
        v = val * scale
        while mask:
            low = mask & -mask
            out[pos[low.bit_length() - 1]] = v
            mask ^= low
    return out
