"""Return freed heap memory to the OS (glibc), so a burst of large peer messages is not kept for good.

A hostile or merely bursty peer makes the controller allocate and free many MB-sized buffers
(frames, decoded lists). glibc's malloc raises its mmap threshold dynamically after the first
large free, after which such buffers come from the heap, and heap pages freed below live
objects are only returned by ``malloc_trim`` (``bench/soak.py`` shows how much it gives back).
Two measures, both no-ops where glibc is absent:

- :func:`tune_malloc` pins the mmap threshold (pinning also turns the dynamic raise off), so
  buffers over it are mapped and unmapped on their own;
- :class:`Trimmer` calls ``malloc_trim(0)`` from a thread (ctypes drops the GIL) every few
  seconds, but only when the heap holds enough free memory that it has not offered back yet.

Why the gate: ``malloc_trim`` holds each arena's lock while it walks every free chunk and
``madvise``s its pages, and the event loop's thread allocates from the main arena, so it sleeps
on that lock for the whole walk (no CPU spent, the loop stalled: ``bench/soak.py``'s stall probe
caught it). An ungated trim every 5 s repeats that walk even
when nothing was freed since the last one (already-returned pages are walked and advised again).
``mallinfo2`` reads the free total (a walk of the bins without syscalls, far cheaper), so a trim
runs only after a burst actually left ``min_free`` bytes more free than the last trim left (or,
while that much is free at all, once a minute: pages reused and freed again between two checks).

The gate matters most under ``PYTHONMALLOC=malloc``, where the heap holds every small object and a
trim walks all of it (``bench/soak.py --sample-loop``; figures in docs/measurements.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import sys
import time

import numpy as np

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations at least this large are mmapped (and unmapped when freed).
MMAP_THRESHOLD = 256 << 10
#: Free heap bytes beyond what the last trim left that make the next trim worth its lock time.
TRIM_MIN_FREE = 4 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt")):
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


#: ``advanced.allocator`` values: the C allocator for every object, or CPython's small-object arenas.
ALLOCATORS = ("malloc", "pymalloc")


def running_allocator() -> str:
    """The allocator this interpreter started with (``PYTHONMALLOC`` is read only at start)."""
    return "malloc" if os.environ.get("PYTHONMALLOC", "").startswith("malloc") else "pymalloc"


def exec_with_allocator(allocator: str) -> None:
    """Restart this process (same pid, same command line) under ``allocator`` if it runs another.

    What ``malloc`` buys: pymalloc returns a 1 MiB arena to the OS only once every object in it is
    freed, so a burst of short-lived objects with a few long-lived ones among them (a counter's
    latest value, a new session's entry) keeps most of its arenas resident for good; under
    ``PYTHONMALLOC=malloc`` a survivor pins a 4 KiB page and :class:`Trimmer` returns the rest
    (``bench/controller.py --probe inflight_bytes``, ``bench/soak.py``). What it costs: every small
    object comes from glibc, which lowers the KV-event ingest and route rates
    (``PYTHONMALLOC=malloc|pymalloc python bench/controller.py --quick``, alternated), and a trim
    walks a larger heap while the loop waits on its lock. Figures: docs/measurements.md. Hence pymalloc by default, ``malloc``
    where memory after bursts matters more than peak rate. An explicit ``PYTHONMALLOC`` other
    than these two
    (e.g. ``malloc_debug``) is left as it is.
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    current = os.environ.get("PYTHONMALLOC")
    if current not in (None, "", "malloc", "pymalloc"):
        log.warning("PYTHONMALLOC=%s set explicitly: advanced.allocator %s not applied", current, allocator)
        return
    if running_allocator() == allocator:
        return
    if "--multiprocessing-fork" in sys.orig_argv:  # a spawned child: its command line cannot be rerun
        log.warning("started by multiprocessing: advanced.allocator %s not applied (runs %s)", allocator,
                    running_allocator())
        return
    env = dict(os.environ, PYTHONMALLOC=allocator)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap and trim thresholds; False when this is not glibc."""
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * mmap_threshold))
    if not ok:
        log.warning("mallopt refused the thresholds: freed memory may be kept by the allocator")
    return ok


def heap_info() -> dict[str, int] | None:
    """glibc's ``mallinfo2`` (all arenas): ``arena`` heap bytes, ``uordblks`` in use, ``fordblks``
    free, ``hblkhd`` mmapped, ``keepcost`` the releasable top; None without glibc >= 2.33."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    mi = libc.mallinfo2()
    return {name: int(getattr(mi, name)) for name, _ in _MallInfo2._fields_}


def malloc_trim() -> bool:
    """Give free heap pages back to the OS now; True when glibc released any."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


class Trimmer:
    """Periodic, gated ``malloc_trim`` (see the module docstring), with what each trim cost.

    ``spans`` keeps the (start, end) ``time.perf_counter()`` of recent calls (the gate's check
    included), so a loop-stall probe can tell whether a stall overlapped one; ``stats`` counts
    trims and skips and keeps the longest trim's and the longest check's duration.

    The spans live in a preallocated array, not a deque of tuples: a tuple and two floats made
    every few seconds and kept for an hour land in whatever pymalloc pools a burst of requests
    just freed, and each one keeps its 1 MiB arena resident after the burst is gone
    (``bench/kit/arena_census.py`` found them pinning most of the arenas a soak left)."""

    def __init__(self, interval_s: float = 5.0, min_free: int = TRIM_MIN_FREE, keep: int = 1024,
                 max_skip_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self.min_free = min_free
        # Free memory reused and freed again between two checks leaves the free total where the
        # last trim left it, with its pages resident again: at most this long without a trim
        # while ``min_free`` bytes are free at all.
        self.max_skip_s = max_skip_s
        self._last_trim = time.monotonic()
        self._spans = np.zeros((keep, 2))
        self._calls = 0
        self.stats = {"trims": 0, "skipped": 0, "max_trim_ms": 0.0, "total_trim_ms": 0.0, "max_check_ms": 0.0}
        self._libc = _libc()
        self._gated = self._libc is not None and hasattr(self._libc, "mallinfo2")
        self._free_after = 0  # free heap bytes the last trim left (pages already returned)

    def due(self) -> bool:
        """Whether the heap holds ``min_free`` more free bytes than the last trim left."""
        if not self._gated:
            return True
        info = self._libc.mallinfo2()  # type: ignore[union-attr]
        free = int(info.fordblks)
        if free < self._free_after:  # reused since: count growth from the lower level
            self._free_after = free
        if free - self._free_after >= self.min_free:
            return True
        return free >= self.min_free and time.monotonic() - self._last_trim >= self.max_skip_s

    def trim_now(self) -> bool:
        """``malloc_trim(0)`` if :meth:`due`, timed; runs in the caller's thread."""
        if self._libc is None:
            return False
        t0 = time.perf_counter()
        if not self.due():
            self.stats["skipped"] += 1
            t1 = time.perf_counter()
            self._record(t0, t1)
            self.stats["max_check_ms"] = max(self.stats["max_check_ms"], (t1 - t0) * 1000)
            return False
        released = bool(self._libc.malloc_trim(0))
        self._last_trim = time.monotonic()
        if self._gated:
            self._free_after = int(self._libc.mallinfo2().fordblks)
        t1 = time.perf_counter()
        self._record(t0, t1)
        ms = (t1 - t0) * 1000
        self.stats["trims"] += 1
        self.stats["total_trim_ms"] += ms
        self.stats["max_trim_ms"] = max(self.stats["max_trim_ms"], ms)
        log.debug("malloc_trim took %.1f ms (released: %s)", ms, released)
        return released

    def _record(self, t0: float, t1: float) -> None:
        row = self._spans[self._calls % len(self._spans)]
        row[0], row[1] = t0, t1
        self._calls += 1

    @property
    def spans(self) -> list[tuple[float, float]]:
        """The recent calls' (start, end), oldest first."""
        keep = len(self._spans)
        n = min(self._calls, keep)
        order = [(self._calls - n + i) % keep for i in range(n)]
        return [(float(a), float(b)) for a, b in self._spans[order]]

    def overlapping(self, start: float, end: float) -> list[tuple[float, float]]:
        """Trims (perf_counter spans) that overlapped ``[start, end]``."""
        return [(a, b) for a, b in self.spans if a < end and b > start]

    async def run(self) -> None:
        """Trim when due every ``interval_s`` in a worker thread, for the life of the task."""
        if self._libc is None:
            log.info("not glibc: no periodic malloc_trim")
            return
        while True:
            await asyncio.sleep(self.interval_s)
            await asyncio.to_thread(self.trim_now)
