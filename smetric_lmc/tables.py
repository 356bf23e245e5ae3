"""Give back the memory of dicts that shrank: CPython never resizes a dict on deletion.

A dict keeps the table of its largest size until an insertion happens to resize it, so a map that
held a peak's in-flight requests keeps that peak's table through an idle spell after every entry
left, and the heap around it cannot be returned either. Owners of maps that swing with load
call :func:`compacted` after removals and keep what it returns: a right-sized copy when the table is
far larger than its entries need, else the same dict.
"""

from __future__ import annotations

import sys
from typing import TypeVar

D = TypeVar("D", bound=dict)

#: A table over this many bytes per entry (plus :data:`SLACK`) is rebuilt. A freshly built dict
#: takes 26-40 B per entry (3.11), up to twice that just before it grows: 128 means "at least 3x
#: the size its entries need", so a dict that is merely between two growth steps is left alone.
BYTES_PER_ENTRY = 128
SLACK = 4096  # small tables are not worth a copy
#: A copy is made once the map holds at most this many entries (or its table is over
#: :data:`HUGE_BYTES_PER_ENTRY` bytes per entry). Copying touches every key and value, scattered
#: over the heap of a busy process (far slower than in a fresh one: ``bench/soak.py
#: --slow-callbacks``), so a map shrinking from a peak keeps its peak's table until a copy is short.
MAX_COPY = 8192
HUGE_BYTES_PER_ENTRY = 2048


def oversized(d: dict) -> bool:
    """Whether ``d``'s table is several times larger than its entries need and ``d`` is small
    enough, for its table, to copy now (O(1))."""
    size, n = sys.getsizeof(d), len(d)
    return size > BYTES_PER_ENTRY * n + SLACK and (n <= MAX_COPY or size > HUGE_BYTES_PER_ENTRY * n)


def compacted(d: D) -> D:
    """``d`` itself, or a right-sized copy (same items, same order) when :func:`oversized`: the
    caller replaces its reference. O(len(d)) when it copies, which is at most a third of the
    deletions since the table was last right-sized, so amortized O(1) per deletion; one copy is
    at most :data:`MAX_COPY` entries or 1/2048 of the table's bytes."""
    return d.copy() if oversized(d) else d  # type: ignore[return-value]
