"""One worker process for the work a single peer message can make linear in its size.

Decoding and checking a frame costs CPU linear in its size (docs/measurements.md has what a
large route or vLLM batch costs); on the event loop that freezes every client and all event
ingest. The route service and the KV-event subscribers hand such frames to this one
spawned process (no ZMQ context inherited) as pure functions of the frame, and get back results
that are cheap to unpickle (numbers and numpy arrays, not millions of Python objects).

``submit`` returns an asyncio future; a worker that died is replaced on the next submit and the
frame it held fails with ``BrokenProcessPool`` (its caller answers or drops that one frame: a
frame that kills the worker must not be retried on the loop).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # multiprocessing is imported when the worker starts, not on a restart's path
    from concurrent.futures import ProcessPoolExecutor

log = logging.getLogger(__name__)

#: Peer frames larger than this are decoded in the worker, not on the loop: their decode cost is
#: linear in their size (route frames, vLLM KV-event batches, LMCache PULL frames alike).
OFFLOAD_BYTES = 256 << 10

T = TypeVar("T")


def _ready() -> bool:
    return True


def _die_with_parent() -> None:
    """Worker initializer: a controller killed with SIGKILL cannot stop its worker, so the kernel
    does (Linux ``PR_SET_PDEATHSIG``); elsewhere the worker exits when its pipes close."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class OffloadWorker:
    """A single spawned worker process, started on demand and replaced when it dies."""

    def __init__(self, name: str = "frame worker") -> None:
        self.name = name
        self._pool: ProcessPoolExecutor | None = None
        self.restarts = 0
        self.unavailable: str | None = None  # why no worker can run here (large frames stay on the loop)

    def start(self) -> bool:
        """Spawn the worker now (it takes ~0.5 s), so the first large frame does not wait for it.

        False when this process may not have children (a daemonic multiprocessing process): the
        callers then handle large frames on the loop, count them, and this says so once in the log."""
        if self._pool is None and self.unavailable is None:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            try:
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"),
                                                 initializer=_die_with_parent)
                self._pool.submit(_ready)
            except (AssertionError, OSError) as exc:  # multiprocessing asserts a daemon has no children
                self._pool = None
                self.unavailable = f"{type(exc).__name__}: {exc}"
                log.error("%s: cannot start (%s); large frames are handled on the event loop",
                          self.name, self.unavailable)
        return self._pool is not None

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run ``fn(*args)`` (picklable, module-level) in the worker."""
        if not self.start():
            raise RuntimeError(f"no {self.name}: {self.unavailable}")
        assert self._pool is not None
        from concurrent.futures.process import BrokenProcessPool

        try:
            fut: Future[T] = self._pool.submit(fn, *args)
        except BrokenProcessPool:
            log.error("%s died; starting a new one", self.name)
            self.restarts += 1
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            self.start()
            assert self._pool is not None
            fut = self._pool.submit(fn, *args)
        return asyncio.wrap_future(fut)

    def close(self) -> None:
        """Stop the worker for good: the sockets sharing it may still get a large frame while the
        controller shuts down, and must not start another (they handle it on the loop)."""
        self.unavailable = "closed"
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
