"""Prefix lookups over monotone holder masks, and their per-instance result."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from smetric_lmc.index.table import KeyIndex

Groups = list[tuple[int, int]]  # (slot mask, hit length): disjoint masks, one per distinct hit


class Lookup:
    """Result of a prefix lookup. Per-instance lists are indexed like ``TierIndex.instances``."""

    __slots__ = ("local_tokens", "global_chunks", "block_size", "chunk_size", "stale_blocks", "_gpu", "_lmc",
                 "_pos", "_n", "_all")

    def __init__(self, local_tokens: list[int], gpu: Groups, lmc: Groups, global_chunks: int, block_size: int,
                 chunk_size: int, pos: list[int], n: int, all_mask: int, stale_blocks: list[int] | None) -> None:
        self.local_tokens = local_tokens  # per instance: max of GPU (+ pending) hit and LMCache hit
        self.global_chunks = global_chunks
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.stale_blocks = stale_blocks  # per instance: GPU hit blocks only held stale; None = none
        self._gpu, self._lmc, self._pos, self._n, self._all = gpu, lmc, pos, n, all_mask

    def local_hit_tokens(self) -> list[int]:
        return self.local_tokens

    def stale_hit_tokens(self) -> list[int]:
        """Per instance: how many of its GPU hit tokens come from entries marked stale (the hit's
        tail: a fresh store refreshes everything above it)."""
        if self.stale_blocks is None:
            return [0] * self._n
        return [b * self.block_size for b in self.stale_blocks]

    @property
    def gpu_blocks(self) -> list[int]:
        return expand(self._gpu, 1, self._pos, self._n, self._all)

    @property
    def lmcache_chunks(self) -> list[int]:
        return expand(self._lmc, 1, self._pos, self._n, self._all)

    @property
    def global_hit_tokens(self) -> int:
        return self.global_chunks * self.chunk_size


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
