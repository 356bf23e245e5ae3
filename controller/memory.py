"""Return freed heap memory to the OS (glibc), so a burst of large peer messages is not kept for good.

A hostile or merely bursty peer makes the controller allocate and free many MB-sized buffers
(frames, decoded lists). glibc's malloc raises its mmap threshold dynamically after the first
large free, after which such buffers come from the heap, and heap pages freed below live
objects are only returned by ``malloc_trim``: the soak saw 690 MB of 716 MB RSS growth that
``malloc_trim`` gave back at once. Two measures, both no-ops where glibc is absent:

- :func:`tune_malloc` pins the mmap threshold (pinning also turns the dynamic raise off), so
  buffers over it are mapped and unmapped on their own;
- :func:`trim_periodically` calls ``malloc_trim(0)`` from a thread (ctypes drops the GIL, so
  the event loop keeps running) every few seconds.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations at least this large are mmapped (and unmapped when freed).
MMAP_THRESHOLD = 256 << 10


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


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


def malloc_trim() -> bool:
    """Give free heap pages back to the OS now; True when glibc released any."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


async def trim_periodically(interval_s: float = 5.0) -> None:
    """``malloc_trim`` every ``interval_s`` in a worker thread, for the life of the task."""
    if _libc() is None:
        log.info("not glibc: no periodic malloc_trim")
        return
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(malloc_trim)
