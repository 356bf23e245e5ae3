"""Per-instance bookkeeping of which LMCache worker/location sources hold each chunk."""

from __future__ import annotations

from collections.abc import Callable, Iterable

Slot = tuple[str, int, str]  # (lmcache instance id, worker id, location)


class SlotsExhausted(ValueError):
    """An instance already has its maximum number of (worker, location) sources."""


class Holdings:
    """Which (worker, location) sources of one instance hold each chunk.

    The sink is per instance while LMCache reports per worker and per location (CPU, disk).
    A chunk leaves the instance only when its last source drops it, so an eviction from CPU does
    not hide a copy still on disk and one rank re-registering does not wipe the other ranks.
    """

    def __init__(self, max_slots: int = 256) -> None:
        self.bits: dict[Slot, int] = {}
        self.chunks: dict[int, int] = {}
        self.max_slots = max_slots
        # Bits of dropped slots, reused first so masks stay as narrow as the live sources.
        self._free: list[int] = []
        self._next = 1

    def bit(self, slot: Slot) -> int | None:
        """The slot's bit, allocated in O(1); None when ``max_slots`` sources already feed this instance."""
        b = self.bits.get(slot)
        if b is None:
            if self._free:
                b = self._free.pop()
            elif len(self.bits) < self.max_slots:
                b = self._next
                self._next <<= 1
            else:
                return None
            self.bits[slot] = b
        return b

    def apply(self, slot: Slot, ops: Iterable[tuple[bool, int]]) -> tuple[list[int], list[int]]:
        """Apply (is_admit, key) ops in order; return the instance-level (admitted, evicted).

        Raises ``SlotsExhausted`` when the slot is new and the instance has no bit left for it.
        """
        b = self.bit(slot)
        if b is None:
            raise SlotsExhausted(f"more than {self.max_slots} LMCache sources for one instance")
        chunks = self.chunks
        before: dict[int, int] = {}
        for is_admit, key in ops:
            mask = chunks.get(key, 0)
            if key not in before:
                before[key] = mask
            if is_admit:
                chunks[key] = mask | b
            elif mask & b:
                mask &= ~b
                if mask:
                    chunks[key] = mask
                else:
                    del chunks[key]
        admitted = [k for k, m in before.items() if not m and k in chunks]
        evicted = [k for k, m in before.items() if m and k not in chunks]
        return admitted, evicted

    def drop(self, match: Callable[[Slot], bool]) -> list[int]:
        """Forget every source matching ``match``; return the chunks the instance no longer holds."""
        mask = 0
        for slot in [s for s in self.bits if match(s)]:
            b = self.bits.pop(slot)
            self._free.append(b)
            mask |= b
        if not mask:
            return []
        gone: list[int] = []
        keep = ~mask
        for key, m in list(self.chunks.items()):
            if m & mask:
                m &= keep
                if m:
                    self.chunks[key] = m
                else:
                    del self.chunks[key]
                    gone.append(key)
        return gone

    def prefix_len(self, slot: Slot, hashes: list[int]) -> int:
        b = self.bits.get(slot)
        if b is None:
            return 0
        n = 0
        for h in hashes:
            if not self.chunks.get(h, 0) & b:
                break
            n += 1
        return n
