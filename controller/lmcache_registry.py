"""The LMCache worker registry: which workers the server knows, bounded, and when they go.

A worker is keyed by LMCache's (``lmcache_instance_id``, ``worker_id``) and mapped to one of our
instance ids by a resolver. Workers of a configured instance are capped per instance, unmapped
ones (ids nothing resolves) all together, so ghosts cannot lock out the real workers. Workers
silent for ``worker_timeout_s`` are forgotten by ``sweep``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)


class LMCacheSink(Protocol):
    """Index-side receiver of LMCache local-tier reports, keyed by our instance id."""

    def lmcache_admit(self, instance_id: str, chunk_hashes: Iterable[int]) -> None: ...

    def lmcache_evict(self, instance_id: str, chunk_hashes: Iterable[int]) -> None: ...

    def lmcache_cleared(self, instance_id: str) -> None: ...

    def lmcache_worker_seen(self, instance_id: str) -> None: ...


SYNCING, COMPLETED, FAILED = "syncing", "completed", "failed"


@dataclass
class Sync:
    """A worker's full sync at one location (the handshake is lmcache_sync's)."""

    sync_id: str
    location: str
    expected_batches: int
    state: str = SYNCING
    batches: set[int] = field(default_factory=set)
    first_missing: int = 0  # every batch below it arrived
    keys_received: int = 0
    last_activity: float = field(default_factory=time.monotonic)


def identity_resolver(lmcache_instance_id: str, worker_id: int) -> str | None:
    """Default mapping: LMCache's ``lmcache_instance_id`` is our instance id, for every rank."""
    return lmcache_instance_id


@dataclass(frozen=True)
class WorkerInfo:
    """One LMCache worker as the server knows it, at one instant."""

    lmcache_instance_id: str
    worker_id: int
    instance_id: str | None
    ip: str
    port: int
    peer_init_url: str | None
    registered: bool
    registered_at: float
    last_seen: float
    last_heartbeat: float | None
    sync_state: str | None


@dataclass
class Worker:
    lmc_id: str
    worker_id: int
    ip: str = ""
    port: int = 0
    peer_init_url: str | None = None
    instance_id: str | None = None
    # False while the worker is known only from PUSHed reports (e.g. after our restart, before
    # its next heartbeat re-registers it).
    registered: bool = False
    registered_at: float = 0.0
    last_seen: float = 0.0
    last_heartbeat: float | None = None
    sync: Sync | None = None
    seq: dict[str, int] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        return self.lmc_id, self.worker_id

    def set_addr(self, ip: str, port: int, peer_init_url: str | None) -> None:
        self.ip, self.port, self.peer_init_url = ip, port, peer_init_url
        self.registered = True
        self.registered_at = time.time()


class WorkerRegistry:
    def __init__(
        self,
        sink: LMCacheSink,
        resolve: Callable[[str, int], str | None],
        stats: dict[str, int],
        *,
        max_workers: int,
        max_sources: int,
        worker_timeout_s: float,
    ) -> None:
        self._sink = sink
        self._resolve = resolve
        self._stats = stats
        self.max_workers = max_workers
        self.max_sources = max_sources
        self.worker_timeout_s = worker_timeout_s
        self.workers: dict[tuple[str, int], Worker] = {}
        self._counts: dict[str | None, int] = {}  # workers per instance id (None: unmapped)
        self._last_sweep = 0.0
        #: Called with each forgotten worker (its reports are dropped, the upstream told).
        self.on_forget: Callable[[Worker], None] = lambda w: None

    def get(self, lmc_id: str, worker_id: int, *, create: bool = True) -> Worker | None:
        """The known worker (created if ``create``), marked seen; None when unknown or its share is full."""
        key = (lmc_id, worker_id)
        w = self.workers.get(key)
        if w is None and create:
            iid = self._resolve_id(lmc_id, worker_id)
            cap = self.max_workers if iid is None else self.max_sources
            if self._counts.get(iid, 0) >= cap and time.monotonic() - self._last_sweep >= 1.0:
                self.sweep()  # full: forget the silent ones (at most once a second, O(workers))
            if self._counts.get(iid, 0) >= cap:
                self._stats["workers_refused"] += 1
                log.debug("LMCache worker %s/%s refused: %d known for instance %s", lmc_id, worker_id,
                          self._counts.get(iid, 0), iid)
                return None
            w = self.workers[key] = Worker(lmc_id=lmc_id, worker_id=worker_id, instance_id=iid)
            self._counts[iid] = self._counts.get(iid, 0) + 1
        if w is not None:
            w.last_seen = time.time()
            if w.instance_id is not None:
                self._sink.lmcache_worker_seen(w.instance_id)
        return w

    def _resolve_id(self, lmc_id: str, worker_id: int) -> str | None:
        try:
            return self._resolve(lmc_id, worker_id)
        except Exception:
            self._stats["internal_errors"] += 1
            log.exception("resolve_instance(%r, %r) failed", lmc_id, worker_id)
            return None

    def forget(self, key: tuple[str, int]) -> Worker | None:
        w = self.workers.pop(key, None)
        if w is not None:
            self._counts[w.instance_id] -= 1
            self.on_forget(w)
        return w

    def _expired(self, w: Worker, cutoff: float) -> bool:
        # Workers mapped to an instance stay while heartbeats are off (LMCache's default):
        # silence then says nothing, and their sources are bounded per instance anyway.
        if w.last_seen >= cutoff:
            return False
        return w.instance_id is None or w.last_heartbeat is not None

    def sweep(self) -> int:
        """Forget workers silent for ``worker_timeout_s`` (see ``_expired``); returns how many."""
        self._last_sweep = time.monotonic()
        cutoff = time.time() - self.worker_timeout_s
        gone = [w for w in self.workers.values() if self._expired(w, cutoff)]
        for w in gone:
            self.forget(w.key)
            log.info("LMCache worker %s/%d silent for %.0fs: forgotten", w.lmc_id, w.worker_id,
                     self.worker_timeout_s)
        self._stats["workers_expired"] += len(gone)
        return len(gone)
