"""Short-lived per-instance records kept beside the tree: pending routed prompts and orphan runs."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from smetric_lmc.tables import compacted

#: Pending entries (or orphan blocks) one ``expire`` call drops at most: a short slice of the
#: loop even when a whole burst's prompts or a full cap of orphans fall due together.
EXPIRE_SLICE = 4096
#: Drops between two checks for maps that shrank (``smetric_lmc.tables``).
COMPACT_EVERY = 1024


def _anchor(length: int) -> int:
    """Where a pending prompt of ``length`` blocks is filed: a multiple of 64 blocks (1k tokens
    at 16-token blocks), or a power of two for short prompts. A query probes only the anchor
    positions in use, at most 6 + n/64 of them, not every block."""
    return length & ~63 if length >= 64 else 1 << (length.bit_length() - 1)


_LENGTH = (1 << 32) - 1  # the length's bits in ``Pending.meta``


class Pending:
    """Prompts routed to an instance whose blocks its engine has not reported yet.

    A routed prompt is kept as (instance slot, its last block hash, its length, deadline): the
    chain hash of the last block stands for the whole prefix, so a later prompt extends it iff it
    has that hash at that position. Candidates are found through the hash at the prompt's anchor
    position (see ``_anchor``), then checked at their last block. A partial overlap is not
    credited until the engine's events land. The engine's store of the last block confirms the
    entry; otherwise it expires at its deadline.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        # Only ints, floats and dicts of them, never a tuple holding a dict: none of it is tracked
        # by the cyclic GC (a busy controller holds one entry per routed prompt for ``ttl_s``).
        self.by_last: dict[int, dict[int, float]] = {}  # last -> {slot: deadline}
        # last -> anchor hash << 32 | length: one int, not a (length, anchor) tuple, which is
        # GC-tracked when made (see ``queue``).
        self.meta: dict[int, int] = {}
        # anchor block hash -> the last hash filed there (an int: the usual case, one prompt per
        # anchor, costs no container) or, once several are, a dict of them (values None). Dicts,
        # not sets: a dict of ints is not tracked by the cyclic GC, a set always is, and a busy
        # controller holds one per routed prompt for ``ttl_s``: every full collection walked them.
        self.by_anchor: dict[int, int | dict[int, None]] = {}
        self.anchors: dict[int, int] = {}  # anchor position in use -> entries filed there
        # Flat (deadline, slot, last, deadline, slot, last, ...), not a tuple per entry: tuples
        # are GC-tracked when made, and one per route freed by expiry as new ones are made kept
        # CPython's generation-0 count below its threshold while young tuples piled up (one long
        # gen-0 collection, see smetric_lmc/load.py). Floats and ints are untracked.
        self.queue: deque[float | int] = deque()
        self.added = self.confirmed = self.expired = 0
        self._dropped = 0  # since the last check for shrunken maps

    def __bool__(self) -> bool:
        return bool(self.by_last)

    def add(self, slot: int, chain: Sequence[int], now: float) -> None:
        last = chain[-1]
        entry = self.by_last.get(last)
        if entry is None:
            pos = _anchor(len(chain))
            entry = self.by_last[last] = {}
            self.meta[last] = chain[pos - 1] << 32 | len(chain)
            self._file(chain[pos - 1], last)
            self.anchors[pos] = self.anchors.get(pos, 0) + 1
        deadline = now + self.ttl_s
        entry[slot] = deadline
        self.queue.extend((deadline, slot, last))
        self.added += 1

    def _drop(self, last: int, slot: int) -> None:
        slots = self.by_last[last]
        del slots[slot]
        if slots:
            return
        del self.by_last[last]
        packed = self.meta.pop(last)
        length, anchor = packed & _LENGTH, packed >> 32
        filed = self.by_anchor[anchor]
        if type(filed) is not dict:
            if filed == last:
                del self.by_anchor[anchor]
        else:
            filed.pop(last, None)
            if len(filed) == 1:  # back to the single-int form
                self.by_anchor[anchor] = next(iter(filed))
            elif not filed:
                del self.by_anchor[anchor]
        pos = _anchor(length)
        left = self.anchors[pos] - 1
        if left:
            self.anchors[pos] = left
        else:
            del self.anchors[pos]
        self._dropped += 1

    def _file(self, anchor: int, last: int) -> None:
        filed = self.by_anchor.get(anchor)
        if filed is None:
            self.by_anchor[anchor] = last
        elif type(filed) is not dict:
            if filed != last:
                self.by_anchor[anchor] = {filed: None, last: None}
        else:
            filed[last] = None

    def _maybe_compact(self) -> None:
        """Right-size the maps after many drops: a dict keeps the table of its peak (one entry
        per distinct prompt routed within ``ttl_s``) until an insertion resizes it, so an idle
        controller kept a busy spell's tables for good."""
        if self._dropped >= COMPACT_EVERY:
            self._dropped = 0
            self.by_last = compacted(self.by_last)
            self.meta = compacted(self.meta)
            self.by_anchor = compacted(self.by_anchor)

    def confirm(self, slot: int, hashes: Sequence[int]) -> None:
        by_last = self.by_last
        for h in by_last.keys() & hashes:  # the C-level intersection: a store can be long
            if slot in by_last[h]:
                self._drop(h, slot)
                self.confirmed += 1
        self._maybe_compact()

    def expire(self, now: float, budget: int = EXPIRE_SLICE) -> None:
        """Drop entries past their deadline, looking at up to ``budget`` queued ones (the rest,
        if any, stay due: :meth:`next_deadline` is then already past)."""
        q = self.queue
        pop = q.popleft
        while q and q[0] <= now and budget > 0:
            budget -= 1
            deadline, slot, last = pop(), pop(), pop()
            entry = self.by_last.get(last)
            if entry is not None and entry.get(slot) == deadline:
                self._drop(last, slot)
                self.expired += 1
        self._maybe_compact()

    def next_deadline(self) -> float:
        return float(self.queue[0]) if self.queue else float("inf")

    def drop_slot(self, slot: int) -> None:
        for last in [h for h, slots in self.by_last.items() if slot in slots]:
            self._drop(last, slot)
        self._maybe_compact()

    def credits(self, chain: Sequence[int]) -> list[tuple[int, int]]:
        """(slot, pending blocks) for every pending prompt ``chain`` extends."""
        out: list[tuple[int, int]] = []
        n = len(chain)
        by_anchor, by_last, meta = self.by_anchor, self.by_last, self.meta
        for pos in self.anchors:
            if pos <= n:
                filed = by_anchor.get(chain[pos - 1])
                if filed is not None:
                    for last in (filed if type(filed) is dict else (filed,)):
                        length = meta[last] & _LENGTH
                        if length <= n and chain[length - 1] == last:
                            out.extend((slot, length) for slot in by_last[last])
        return out


class Orphans:
    """Block runs stored under a parent the index does not know for that instance (a missed
    event, or a controller that started after the engine). Each run waits, keyed by its parent,
    until that parent is stored by the same instance, then is replayed; runs older than the TTL or
    past the per-instance cap are dropped (counted)."""

    def __init__(self, ttl_s: float, cap_blocks: int) -> None:
        self.ttl_s = ttl_s
        self.cap = cap_blocks
        self.by_parent: dict[tuple[int, int], list[list[Any]]] = {}  # (slot, parent key) -> runs
        self.by_hash: dict[tuple[int, int], list[Any]] = {}  # (slot, engine hash) -> run (removals)
        self.blocks: dict[int, int] = {}  # slot -> blocks waiting
        self.queue: deque[tuple[float, int, int, list[Any]]] = deque()  # every run, by deadline
        self.fifo: dict[int, deque[tuple[int, list[Any]]]] = {}  # slot -> its runs, oldest first (cap)
        self.kept = self.adopted = self.dropped = 0

    def waiting(self, slot: int) -> bool:
        return self.blocks.get(slot, 0) > 0

    def keep(self, slot: int, parent: int, run: list[Any], now: float) -> None:
        """``run`` = [engine hashes or None, our hashes or None, token ids, lora name, extra keys]."""
        self.by_parent.setdefault((slot, parent), []).append(run)
        n = len(run[0] if run[0] is not None else run[1])
        if run[0] is not None:
            for e in run[0]:
                self.by_hash[(slot, e)] = run
        self.blocks[slot] = self.blocks.get(slot, 0) + n
        self.kept += n
        self.queue.append((now + self.ttl_s, slot, parent, run))
        fifo = self.fifo.setdefault(slot, deque())
        self._trim(fifo)
        fifo.append((parent, run))
        while self.blocks[slot] > self.cap and fifo:  # over the cap: this instance's oldest go
            p, old = fifo.popleft()
            self._forget(slot, p, old)

    def take(self, slot: int, parent: int) -> list[list[Any]]:
        runs = self.by_parent.pop((slot, parent), None)
        if not runs:
            return []
        for run in runs:
            n = self._unindex(slot, run)
            self.adopted += n
            run.append(None)  # marks it taken for the expiry queue
        return runs

    def _unindex(self, slot: int, run: list[Any]) -> int:
        hashes = run[0] if run[0] is not None else run[1]
        if run[0] is not None:
            for e in run[0]:
                if self.by_hash.get((slot, e)) is run:
                    del self.by_hash[(slot, e)]
        self.blocks[slot] -= len(hashes)
        return len(hashes)

    def _forget(self, slot: int, parent: int, run: list[Any]) -> int:
        """Drop ``run`` if it still waits; returns the blocks dropped."""
        if len(run) > 5:  # adopted or dropped already
            return 0
        runs = self.by_parent.get((slot, parent))
        if runs is None or not any(r is run for r in runs):
            return 0
        runs[:] = [r for r in runs if r is not run]
        if not runs:
            del self.by_parent[(slot, parent)]
        n = self._unindex(slot, run)
        self.dropped += n
        run.append(None)  # done with, like an adopted run
        return n

    @staticmethod
    def _trim(fifo: deque[tuple[int, list[Any]]]) -> None:
        """Let go of runs at the front that were adopted or dropped already."""
        while fifo and len(fifo[0][1]) > 5:
            fifo.popleft()

    def expire(self, now: float, budget: int = EXPIRE_SLICE) -> None:
        """Drop runs past their deadline, about ``budget`` blocks' worth (the rest, if any, stay
        due): a whole cap of orphans falling due together would otherwise be one long stall."""
        q = self.queue
        while q and q[0][0] <= now and budget > 0:
            _, slot, parent, run = q.popleft()
            budget -= self._forget(slot, parent, run) or 1
            fifo = self.fifo.get(slot)
            if fifo is not None:
                self._trim(fifo)

    def next_deadline(self) -> float:
        return self.queue[0][0] if self.queue else float("inf")

    def removed(self, slot: int, e: int) -> bool:
        """An engine removed block ``e`` of a waiting run: the run keeps only what precedes it."""
        run = self.by_hash.get((slot, e))
        if run is None:
            return False
        k = run[0].index(e)
        for x in run[0][k:]:
            del self.by_hash[(slot, x)]
        dropped = len(run[0]) - k
        self.blocks[slot] -= dropped
        self.dropped += dropped
        run[0] = run[0][:k]
        run[2] = run[2][: len(run[2]) * k // (k + dropped)]
        if run[4] is not None:
            run[4] = run[4][:k]
        return True

    def drop_slot(self, slot: int) -> None:
        self.fifo.pop(slot, None)
        for key in [k for k in self.by_parent if k[0] == slot]:
            for run in self.by_parent.pop(key):
                self.dropped += self._unindex(slot, run)
                run.append(None)
        self.blocks.pop(slot, None)
