"""LMCache workers' KV reports turned into index updates, and the P2P lookup over them.

Admits and evicts arrive per worker and per location (CPU, disk); the index sink is per
instance. ``Holdings`` keeps which sources hold each chunk, so a chunk leaves an instance only
when its last source drops it. A large batch (or full-sync batch) is applied ``OPS_SLICE`` entries
at a time: ``pending`` stays true while slices are left, and the PULL loop yields before each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from smetric_lmc.controller import lmcache_proto as P
from smetric_lmc.controller.lmcache_holdings import Holdings, SlotsExhausted
from smetric_lmc.controller.lmcache_registry import LMCacheSink, Worker, WorkerRegistry

log = logging.getLogger(__name__)

#: Operations of one KV-op batch applied between two yields to the loop.
OPS_SLICE = 4096


class _Rest(NamedTuple):
    """A PULL message's bulk list, applied ``OPS_SLICE`` entries at a time from ``start``."""

    lmc_id: str
    worker_id: int
    location: str
    bulk: P.Bulk
    start: int
    sync: bool  # full-sync keys (all admits), else KV operations


def _plain(values: Any) -> list[Any]:
    """A column slice as a list of Python scalars (numpy's would end up in the index's tables)."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


class KVOps:
    def __init__(self, sink: LMCacheSink, registry: WorkerRegistry, stats: dict[str, int],
                 syncing: Callable[[Worker], bool]) -> None:
        self._sink = sink
        self._registry = registry
        self._stats = stats
        self._syncing = syncing  # True while a full sync of that worker runs: its ops are dropped
        self.holdings: dict[str, Holdings] = {}
        self._rest: _Rest | None = None  # a batch applied a slice at a time

    @property
    def pending(self) -> bool:
        """True while a batch has slices left (``apply_next_slice`` applies the next)."""
        return self._rest is not None

    def drop_pending(self) -> None:
        self._rest = None

    def queue(self, lmc_id: str, worker_id: int, location: str, bulk: P.Bulk, *, sync: bool) -> None:
        """Apply a bulk list: the first slice now, the rest through ``apply_next_slice``."""
        self._rest = _Rest(lmc_id, worker_id, location, bulk, 0, sync=sync)
        self.apply_next_slice()

    def apply_next_slice(self) -> bool:
        """Apply the next ``OPS_SLICE`` operations (or full-sync keys); True while more are left.
        Each slice of operations goes through ``on_ops`` again, so a full sync that started
        meanwhile takes over, as it would between batches; a full-sync batch stops when its
        worker is gone."""
        assert self._rest is not None
        r = self._rest
        end = min(r.start + OPS_SLICE, len(r.bulk.keys))
        self._rest = r._replace(start=end) if end < len(r.bulk.keys) else None
        keys = _plain(r.bulk.keys[r.start:end])
        if not r.sync:
            admits, seqs = _plain(r.bulk.admits[r.start:end]), _plain(r.bulk.seqs[r.start:end])
            self.on_ops(r.lmc_id, r.worker_id, r.location, list(zip(admits, keys, seqs, strict=True)))
        else:
            w = self._registry.workers.get((r.lmc_id, r.worker_id))
            if w is None or w.instance_id is None:
                self._rest = None
                return False
            self.apply(w, r.location, [(True, k) for k in keys])
        return self._rest is not None

    def on_ops(self, lmc_id: str, worker_id: int, location: str, ops: list[tuple[bool, int, int]]) -> None:
        """(is_admit, key, seq) operations of one worker at one location."""
        self._stats["kv_ops"] += len(ops)
        if not ops:
            return
        w = self._registry.get(lmc_id, worker_id)
        if w is None:
            return
        if self._syncing(w):
            # The running full sync is the truth for this worker; LMCache discards these too.
            self._stats["kv_ops_during_sync"] += len(ops)
            return
        last = w.seq.get(location)
        for _, _, seq in ops:
            if last is not None and seq != last + 1:
                self._stats["seq_gaps"] += 1
            last = seq
        w.seq[location] = last  # type: ignore[assignment]
        if w.instance_id is None:
            self._stats["kv_ops_unresolved"] += len(ops)
            return
        self.apply(w, location, [(a, k) for a, k, _ in ops])

    def _holdings_of(self, instance_id: str) -> Holdings:
        h = self.holdings.get(instance_id)
        if h is None:
            h = self.holdings[instance_id] = Holdings(self._registry.max_sources)
        return h

    def apply(self, w: Worker, location: str, ops: list[tuple[bool, int]]) -> None:
        assert w.instance_id is not None
        h = self._holdings_of(w.instance_id)
        try:
            admitted, evicted = h.apply((w.lmc_id, w.worker_id, location), ops)
        except SlotsExhausted as exc:
            self._stats["sources_refused"] += 1
            log.debug("LMCache ops of %s/%s at %s refused: %s", w.lmc_id, w.worker_id, location, exc)
            return
        if evicted:
            self._sink.lmcache_evict(w.instance_id, evicted)
        if admitted:
            self._sink.lmcache_admit(w.instance_id, admitted)

    def clear_sources(self, w: Worker, location: str | None) -> None:
        """Forget what ``w`` reported (one location or all) and tell the sink what left."""
        if w.instance_id is None:
            return
        h = self._holdings_of(w.instance_id)
        gone = h.drop(lambda s: s[0] == w.lmc_id and s[1] == w.worker_id
                      and (location is None or s[2] == location))
        if not h.chunks:
            self._sink.lmcache_cleared(w.instance_id)
        elif gone:
            self._sink.lmcache_evict(w.instance_id, gone)

    def p2p_lookup(self, msg: P.BatchedP2PLookupMsg) -> P.BatchedP2PLookupRetMsg:
        self._stats["p2p_lookups"] += 1
        self._registry.get(msg.instance_id, msg.worker_id, create=False)
        none = P.BatchedP2PLookupRetMsg(layout_info=[("", "", 0, "")])
        if not msg.hashes:
            return none
        # LMCache answers with the first registered holder of the first chunk; the longest prefix
        # among peers is never worse for the requester, and equals it when one peer holds it.
        best: tuple[int, str, str, str] | None = None
        # One pass over the sources (bounded per instance), not workers x sources.
        for h in self.holdings.values():
            for slot in h.bits:
                w = self._registry.workers.get((slot[0], slot[1]))
                if w is None or w.lmc_id == msg.instance_id or w.peer_init_url is None:
                    continue
                n = h.prefix_len(slot, msg.hashes)
                if n and (best is None or n > best[0]):
                    best = (n, w.lmc_id, slot[2], w.peer_init_url)
        if best is None:
            return none
        n, lmc_id, location, url = best
        return P.BatchedP2PLookupRetMsg(layout_info=[(lmc_id, location, n, url)])
