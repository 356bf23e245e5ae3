"""Index snapshots of a running controller: the periodic write, and the restore at start.

With ``snapshot.path`` set the index is written there every ``snapshot.interval_s`` (and at a
clean stop) with each instance's last applied KV-event batch (``smetric_lmc.index.snapshot``), by
a forked child (``fork_write``: the loop pays only the fork, the child sees that instant). At
start it is reloaded in slices (the route socket answers meanwhile), then each subscriber starts
and replays its engine's events from the batch after the snapshot's; until every replay has
finished the controller routes by load (``RouteCore.catching_up``). A snapshot that does not load
(corrupt, other hashing) is logged and ignored.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from smetric_lmc.controller.service import RouteCore
from smetric_lmc.index import TierIndex
from smetric_lmc.index import snapshot as index_snapshot

log = logging.getLogger(__name__)

Spawn = Callable[[str, Callable[[], Awaitable[Any]]], None]


class IndexSnapshots:
    def __init__(self, path: str | None, interval_s: float, index: TierIndex, core: RouteCore,
                 subscribers: Mapping[str, Any]) -> None:
        self.path = path
        self.interval_s = interval_s
        self.index = index
        self.core = core
        self.subscribers = subscribers  # instance id -> its KV-event subscriber (filled by the wiring)
        self.stats: dict[str, Any] = {"written": 0, "failed": 0, "bytes": 0, "restored_blocks": 0,
                                      "restore_s": None, "last_write_s": None, "catch_up_s": None,
                                      "fork_ms": None}
        self._lock = asyncio.Lock()

    def read(self) -> index_snapshot.IndexSnapshot | None:
        """The snapshot to restore, or None (none configured, none there, or not loadable)."""
        if not self.path:
            return None
        try:
            snap = index_snapshot.read(self.path)
            if snap is not None:
                index_snapshot.check_compatible(self.index, snap)
        except (index_snapshot.SnapshotError, OSError) as exc:
            log.error("index snapshot: %s not loaded (%s); starting empty", self.path, exc)
            return None
        if snap is None:
            log.info("index snapshot: none at %s; starting empty", self.path)
        return snap

    async def restore_then_resume(self, snap: index_snapshot.IndexSnapshot, known: Collection[str],
                                  spawn: Spawn) -> None:
        """Restore in slices (routes are answered, by load, meanwhile), then start every
        subscriber, resumed from the snapshot's batch, and route by policy once they caught up."""
        t0 = time.monotonic()
        restored: dict[str, int] = {}
        try:
            for _ in index_snapshot.restore_slices(self.index, snap, known, restored):
                await asyncio.sleep(0)
        except Exception:
            log.exception("index snapshot: restore failed after %d blocks; what was restored is marked stale",
                          sum(restored.values()))
            for iid in restored:
                self.index.mark_stale(iid)
        gc.freeze()  # the restored index lives on: out of the reach of full collections, like start-up's
        self.stats["restored_blocks"] = sum(restored.values())
        self.stats["restore_s"] = round(time.monotonic() - t0, 3)
        log.info("index snapshot: restored %d blocks of %d instances (age %.1fs) in %.2fs",
                 sum(restored.values()), len(restored), time.time() - snap.created, time.monotonic() - t0)
        waiting = []
        for iid, sub in self.subscribers.items():
            inst = snap.instances.get(iid)
            if inst is not None and inst.seq is not None:
                sub.resume(inst.seq, inst.ts)
                waiting.append(sub)
            spawn(f"kv-events-{iid}", sub.run)
        await asyncio.gather(*(s.caught_up.wait() for s in waiting))
        self.core.catching_up = False
        self.stats["catch_up_s"] = round(time.monotonic() - t0, 3)
        log.info("index snapshot: restored and %d engines replayed in %.2fs: routing by policy",
                 len(waiting), time.monotonic() - t0)

    async def write(self) -> bool:
        """Snapshot the index now; True when written. A forked child takes and writes it (index
        and event positions as they were at the fork); where there is no fork, the export runs on
        the loop and the file is written on a thread."""
        path = self.path
        if not path:
            return False
        async with self._lock:
            t0 = time.monotonic()
            positions = {iid: s.position() for iid, s in self.subscribers.items()}
            try:
                if hasattr(os, "fork"):
                    job = index_snapshot.fork_write(path, self.index, positions)
                    self.stats["fork_ms"] = round((time.monotonic() - t0) * 1000, 2)
                    size = await asyncio.to_thread(job.wait)
                else:
                    snap = index_snapshot.take(self.index, positions)
                    size = await asyncio.to_thread(index_snapshot.write, path, snap)
            except OSError as exc:
                self.stats["failed"] += 1
                log.error("index snapshot: cannot write %s: %s", path, exc)
                return False
        self.stats["written"] += 1
        self.stats["bytes"] = size
        self.stats["last_write_s"] = round(time.monotonic() - t0, 3)
        log.debug("index snapshot: %d bytes to %s in %.2fs", size, path, time.monotonic() - t0)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.core.catching_up:  # the restored one stays until replays are in
                await self.write()
