"""LMCache's full-sync handshake: a worker re-reports everything it holds at one location.

Start (accepted or refused), batches (tracked for the missing-batch window), end, and status
(per worker, plus the registry-wide progress that lets workers leave their freeze). Like LMCache's
controller, right after start nothing is known about workers' caches, so registered workers are
asked for a full sync until enough of them (``completion_threshold``) completed one.
"""

from __future__ import annotations

import logging
import time

from smetric_lmc.controller import lmcache_proto as P
from smetric_lmc.controller.lmcache_kvops import KVOps
from smetric_lmc.controller.lmcache_registry import COMPLETED, FAILED, SYNCING, Sync, Worker, WorkerRegistry

log = logging.getLogger(__name__)

#: Missing full-sync batches reported per status reply (the worker resends them and asks again).
MISSING_WINDOW = 4096


class FullSync:
    def __init__(self, registry: WorkerRegistry, stats: dict[str, int], *, on_start: bool,
                 completion_threshold: float, timeout_s: float, max_batches: int) -> None:
        self._registry = registry
        self._stats = stats
        self.need_all = on_start  # every registered worker is asked for one until enough completed
        self.threshold = completion_threshold
        self.timeout_s = timeout_s
        self.max_batches = max_batches
        self.kv: KVOps | None = None  # set by the server: where sync keys are applied

    def state(self, w: Worker) -> str | None:
        """The worker's sync state (a sync past ``timeout_s`` of silence has failed)."""
        s = w.sync
        if s is None:
            return None
        if s.state == SYNCING and time.monotonic() - s.last_activity > self.timeout_s:
            s.state = FAILED
            log.warning("full sync %s of %s/%d timed out", s.sync_id, w.lmc_id, w.worker_id)
        return s.state

    def syncing(self, w: Worker) -> bool:
        return self.state(w) == SYNCING

    def command_for(self, w: Worker) -> P.FullSyncCommand | None:
        """The full-sync command a registered worker's heartbeat reply carries, if any."""
        state = self.state(w)
        if self.need_all and state not in (SYNCING, COMPLETED):
            return P.FullSyncCommand(reason="controller_restart")
        if state == FAILED:
            return P.FullSyncCommand(reason="sync_failed_retry")
        return None

    def on_start(self, msg: P.FullSyncStartMsg) -> P.FullSyncStartRetMsg:
        assert self.kv is not None
        w = self._registry.get(msg.instance_id, msg.worker_id, create=False)
        ok = w is not None and w.registered
        if ok and w is not None and self.state(w) == SYNCING and w.sync is not None:
            ok = w.sync.sync_id == msg.sync_id
        if not ok or w is None:
            self._stats["full_sync_rejected"] += 1
            return P.FullSyncStartRetMsg(
                sync_id=msg.sync_id,
                accepted=False,
                error_msg="Failed to start sync: worker already syncing with "
                "different sync_id or worker not found",
            )
        if not 0 <= msg.batch_count <= self.max_batches:
            self._stats["full_sync_rejected"] += 1
            return P.FullSyncStartRetMsg(
                sync_id=msg.sync_id,
                accepted=False,
                error_msg=f"batch_count {msg.batch_count} outside [0, {self.max_batches}] "
                "(limits.lmcache_max_sync_batches)",
            )
        self._stats["full_sync_started"] += 1
        w.sync = Sync(sync_id=msg.sync_id, location=msg.location, expected_batches=msg.batch_count)
        w.seq.pop(msg.location, None)
        self.kv.clear_sources(w, msg.location)
        return P.FullSyncStartRetMsg(sync_id=msg.sync_id, accepted=True)

    def _current(self, lmc_id: str, worker_id: int, sync_id: str) -> tuple[Worker, Sync] | None:
        w = self._registry.get(lmc_id, worker_id, create=False)
        if w is None or w.sync is None or w.sync.sync_id != sync_id or self.state(w) != SYNCING:
            self._stats["full_sync_stray"] += 1
            return None
        return w, w.sync

    def on_batch(self, msg: P.FullSyncBatchMsg, bulk: P.Bulk) -> None:
        assert self.kv is not None
        found = self._current(msg.instance_id, msg.worker_id, msg.sync_id)
        if found is None:
            return
        w, s = found
        if not 0 <= msg.batch_id < s.expected_batches:
            self._stats["full_sync_stray"] += 1
            return
        s.batches.add(msg.batch_id)
        while s.first_missing in s.batches:  # monotonic: O(1) per batch overall
            s.first_missing += 1
        n = len(bulk.keys)
        s.keys_received += n
        s.last_activity = time.monotonic()
        self._stats["kv_ops"] += n
        if w.instance_id is None:
            self._stats["kv_ops_unresolved"] += n
            return
        # As a batch of operations: the PULL loop yields before each further slice.
        self.kv.queue(w.lmc_id, w.worker_id, msg.location, bulk, sync=True)

    def on_end(self, msg: P.FullSyncEndMsg) -> None:
        found = self._current(msg.instance_id, msg.worker_id, msg.sync_id)
        if found is None:
            return
        _, s = found
        if s.keys_received != msg.actual_total_keys:
            log.warning("full sync %s: received %d keys, worker reports %d",
                        s.sync_id, s.keys_received, msg.actual_total_keys)
        s.state = COMPLETED
        s.last_activity = time.monotonic()
        self._stats["full_sync_completed"] += 1

    def on_status(self, msg: P.FullSyncStatusMsg) -> P.FullSyncStatusRetMsg:
        w = self._registry.get(msg.instance_id, msg.worker_id, create=False)
        s = w.sync if w is not None else None
        state = self.state(w) if w is not None else None
        same = s is not None and s.sync_id == msg.sync_id
        missing: list[int] = []
        if same and s is not None and state == SYNCING:
            # A bounded window from the first gap: the worker resends these and asks again.
            top = min(s.expected_batches, s.first_missing + MISSING_WINDOW)
            missing = [b for b in range(s.first_missing, top) if b not in s.batches]
        registered = [x for x in self._registry.workers.values() if x.registered]
        ready = sum(1 for x in registered if self.state(x) in (None, COMPLETED))
        progress = ready / len(registered) if registered else 0.0
        can_exit = progress >= self.threshold
        if can_exit:
            self.need_all = False
        return P.FullSyncStatusRetMsg(
            sync_id=msg.sync_id,
            is_complete=same and state == COMPLETED,
            global_progress=float(progress),
            can_exit_freeze=can_exit,
            missing_batches=missing,
        )
