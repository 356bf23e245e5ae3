"""Open-addressing map from a 64-bit key column to row ids, with no per-entry Python objects.

The keys live in a column owned by the caller (an ``array('Q')`` indexed by row id); this map only
holds row ids in an ``array('I')`` of slots, 0 meaning empty (row 0 is never used). Linear
probing runs *without* wrap-around: the slot array has a tail past its power-of-two home range,
so a probe only ever moves forward. That makes two things cheap:

* deletion by backward shift (no tombstones, so probe lengths never degrade), and
* a vectorized rebuild on growth: with keys sorted by home slot, linear-probing positions are a
  running maximum (``pos[i] = max(home[i], pos[i-1] + 1)``), one numpy pass for millions of keys.

Keys are chain hashes (xxh3, sha256 digests), uniform in their low bits, so a key's home slot is
its low bits. Scalar probes go through ``array`` indexing, which hands back Python ints without the cost of
numpy scalar boxing; a route lookup does a few dozen of them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import numpy as np

TAIL = 1024  # slots past the home range; an insert that would run off it grows the map
MIN_BITS = 10


def _home_np(keys: np.ndarray, mask: int) -> np.ndarray:
    return keys & np.uint64(mask)


class KeyIndex:
    """Key -> row over ``keys`` (a column the caller appends rows to). Load factor kept <= 2/3."""

    __slots__ = ("keys", "slots", "mask", "n", "limit", "end")

    def __init__(self, keys: array, bits: int = MIN_BITS) -> None:
        self.keys = keys
        self.n = 0
        self._size(bits)
        self.slots = array("I", bytes(4 * (self.mask + 1 + TAIL)))

    def _size(self, bits: int) -> None:
        self.mask = (1 << bits) - 1
        self.limit = 2 * (self.mask + 1) // 3
        self.end = self.mask + TAIL  # the last slot: an insert probing into it grows the map

    def locate(self, h: int) -> tuple[int, int]:
        """(slot, row) of key ``h``; when absent, row 0 and the empty slot that ends its probe."""
        slots, keys = self.slots, self.keys
        i = h & self.mask
        r = slots[i]
        while r and keys[r] != h:
            i += 1
            r = slots[i]
        return i, r

    def find(self, h: int) -> int:
        """Row holding key ``h``, or 0."""
        return self.locate(h)[1]

    def put(self, i: int, h: int, row: int) -> None:
        """Insert ``row`` (whose key column holds ``h``) at slot ``i``, which ``locate(h)`` just
        returned for the absent key (saves probing twice on the ingest path)."""
        if self.n >= self.limit or i >= self.end:
            i = self.grow(h)
        self.slots[i] = row
        self.n += 1

    def reserve(self, k: int) -> None:
        """Grow now if ``k`` more keys would pass the load limit, so that a caller inserting them
        with inlined probes need only watch for a probe running into the tail (``end``)."""
        while self.n + k > self.limit:
            self._rebuild(self.mask.bit_length() + 1)

    def grow(self, h: int) -> int:
        """Grow the map; returns the slot absent key ``h`` now goes to. Callers that cache
        ``slots``/``mask``/``end``/``limit`` in locals must reload them after this."""
        while True:  # a probe run into the tail's last slot needs a ~1000-long cluster
            self._rebuild(self.mask.bit_length() + 1)
            i = self.locate(h)[0]
            if i < self.end:
                return i

    def add(self, h: int, row: int) -> bool:
        """Insert ``row`` under ``h`` unless ``h`` is present already (then False)."""
        i, r = self.locate(h)
        if r:
            return False
        self.put(i, h, row)
        return True

    def delete(self, h: int) -> bool:
        """Remove key ``h``; False if absent."""
        i, r = self.locate(h)
        if not r:
            return False
        self.delete_at(i)
        return True

    def drop_rows(self, rows: Iterable[int], zero_keys: bool = False) -> None:
        """Remove the entries of ``rows``, found by row id from their keys' home slots (no key
        comparisons on the way). Their keys must still be in the column: the shifts read them
        (with ``zero_keys`` each is zeroed once its entry is gone). One call for a subtree's or
        an eviction's rows."""
        slots, keys, mask = self.slots, self.keys, self.mask
        for row in rows:
            h = keys[row]
            i = h & mask
            r = slots[i]
            while r != row:
                if not r:
                    raise KeyError(f"row {row} is not in the map under {h:#x}")
                i += 1
                r = slots[i]
            self.delete_at(i)
            if zero_keys:
                keys[row] = 0

    def delete_at(self, i: int) -> None:
        """Empty slot ``i`` (occupied); backward-shift the run behind it so no probe ever crosses a
        hole."""
        slots, keys, mask = self.slots, self.keys, self.mask
        j = i
        while True:
            j += 1
            r = slots[j]
            if not r:
                break
            if keys[r] & mask <= i:
                slots[i] = r
                i = j
        slots[i] = 0
        self.n -= 1

    def _rebuild(self, bits: int) -> None:
        old = np.frombuffer(self.slots, dtype=np.uint32)
        rows = old[old != 0].astype(np.int64)
        del old
        keys = np.frombuffer(self.keys, dtype=np.uint64)
        while True:
            mask = (1 << bits) - 1
            home = _home_np(keys[rows], mask).astype(np.int64)
            order = np.argsort(home, kind="stable")
            home = home[order]
            idx = np.arange(len(home), dtype=np.int64)
            pos = np.maximum.accumulate(home - idx) + idx if len(home) else home
            if not len(pos) or pos[-1] < mask + TAIL - 1:
                break
            bits += 1
        new = np.zeros(mask + 1 + TAIL, dtype=np.uint32)
        new[pos] = rows[order]
        del keys
        self.slots = array("I", new.tobytes())
        self._size(bits)
