"""TierIndex: the two-tier KV index (see the package docstring for the contract)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from smetric_lmc.hashing import FAST_ROOT, fast_chain
from smetric_lmc.index.lookup import Groups, Lookup, bisect, walk
from smetric_lmc.index.side import Orphans, Pending
from smetric_lmc.index.tree import GpuTree

_ADAPTER_DOMAIN = b"smetric-lmc/adapter/v1\x00"
_EXTRA_DOMAIN = b"smetric-lmc/extra/v1\x00"


def adapter_root(base_root: int, name: str) -> int:
    """Chain root of LoRA adapter ``name`` under the base model's root ``base_root``."""
    return xxhash.xxh3_64_intdigest(_ADAPTER_DOMAIN + name.encode("utf-8"), base_root)


def fold_extra(h: int, extra: tuple[Any, ...]) -> int:
    """Fold a block's extra keys (multimodal ids, cache salt, ...) into its chain hash."""
    return xxhash.xxh3_64_intdigest(_EXTRA_DOMAIN + repr(extra).encode("utf-8"), h)


class TierIndex:
    """Event-driven index of the local (GPU, LMCache) and global tiers of every instance."""

    def __init__(
        self,
        block_size: int = 16,
        chunk_size: int = 256,
        *,
        fast_root: int = FAST_ROOT,
        clock: Callable[[], float] = time.monotonic,
        stale_ttl_s: float = 600.0,
        pending_ttl_s: float = 30.0,
        orphan_ttl_s: float = 600.0,
        orphan_cap_blocks: int = 1 << 16,
        sweep_rows: int = 1 << 16,
        sweep_work: int = 1024,
    ) -> None:
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.fast_root = fast_root
        self.clock = clock
        self.stale_ttl_s = stale_ttl_s
        self.sweep_rows = sweep_rows
        self.sweep_work = sweep_work  # rows one slice frees at most: a few ms of the loop
        self._tree = GpuTree()
        self._pending = Pending(pending_ttl_s)
        self._orphans = Orphans(orphan_ttl_s, orphan_cap_blocks)
        self._slots: dict[str, int] = {}
        self._used = 0  # bits of every allocated slot (instances and their stale shadows)
        self._order: list[str] = []  # instance ids in registration order (the view's order)
        self.membership = 0  # bumped whenever ``instances`` changes, so views aligned to it can tell
        self._order_slots: list[int] = []
        self._pos: list[int] = []  # slot -> position in _order (-1: not an instance slot)
        self._all_mask = 0  # bits of every registered instance slot
        self._stale: dict[int, tuple[int, float]] = {}  # instance slot -> (stale slot, deadline)
        self._exc: dict[int, dict[int, int]] = {}  # slot -> {engine hash: our hash} where not shared
        self._adapters: set[str] = set()
        self._adoptable: list[tuple[int, Sequence[int], Sequence[int] | None]] = []
        self._adopting = False
        self._due = float("inf")
        self._lmc: dict[int, int] = {}  # chunk hash -> slot mask
        self._global: set[int] = set()
        self._counts = {
            "gpu_stored": 0,
            "gpu_removed": 0,
            "gpu_unknown_removed": 0,
            "gpu_cleared": 0,
            "gpu_marked_stale": 0,
            "gpu_stale_dropped": 0,
            "lmcache_admitted": 0,
            "lmcache_evicted": 0,
            "global_stored": 0,
            "global_removed": 0,
            "global_resets": 0,
            "unknown_instance": 0,
            "bad_block_size": 0,
        }

    @property
    def stats(self) -> dict[str, int]:
        """Counters (a fresh dict each call)."""
        o, p = self._orphans, self._pending
        return {
            **self._counts,
            "gpu_orphans": o.kept,
            "gpu_orphans_adopted": o.adopted,
            "gpu_orphans_dropped": o.dropped,
            "gpu_orphans_waiting": sum(o.blocks.values()),
            "pending_added": p.added,
            "pending_confirmed": p.confirmed,
            "pending_expired": p.expired,
            "pending_open": sum(len(e) for e in p.by_last.values()),
        }

    # ---- instances -------------------------------------------------------------------------
    @property
    def instances(self) -> list[str]:
        """Registered instances, in the order every per-instance list of a Lookup uses."""
        return self._order

    def _alloc(self) -> int:
        slot = (~self._used & (self._used + 1)).bit_length() - 1
        self._used |= 1 << slot
        while len(self._pos) <= slot:
            self._pos.append(-1)
        return slot

    def _free(self, slot: int) -> None:
        self._used &= ~(1 << slot)
        self._pos[slot] = -1
        self._tree.count.pop(1 << slot, None)

    def register_instance(self, instance_id: str) -> int:
        """Give an instance a slot (idempotent). Returns the slot."""
        slot = self._slots.get(instance_id)
        if slot is not None:
            return slot
        slot = self._alloc()
        self._slots[instance_id] = slot
        self._order.append(instance_id)
        self._order_slots.append(slot)
        self._pos[slot] = len(self._order) - 1
        self._all_mask |= 1 << slot
        self.membership += 1
        return slot

    def drop_instance(self, instance_id: str) -> None:
        """Forget an instance and everything it held."""
        if instance_id not in self._slots:
            return
        self.gpu_cleared(instance_id)
        self._counts["gpu_cleared"] -= 1
        self.lmcache_cleared(instance_id)
        slot = self._slots.pop(instance_id)
        i = self._order.index(instance_id)
        del self._order[i]
        del self._order_slots[i]
        self._free(slot)
        for k, sl in enumerate(self._order_slots):
            self._pos[sl] = k
        self._all_mask &= ~(1 << slot)
        self.membership += 1

    def _slot(self, instance_id: str) -> int | None:
        slot = self._slots.get(instance_id)
        if slot is None:
            self._counts["unknown_instance"] += 1
        return slot

    def _bits(self, slot: int) -> tuple[int, int]:
        """(the instance's bit, its stale shadow's bit or 0)."""
        st = self._stale.get(slot)
        return 1 << slot, (1 << st[0]) if st is not None else 0

    # ---- time-driven upkeep ------------------------------------------------------------------
    def _tick(self) -> None:
        now = self.clock()
        if now >= self._due:
            self.expire(now)

    def expire(self, now: float | None = None) -> None:
        """Drop what has outlived its deadline: stale entries, pending prompts, orphan runs. Runs
        by itself on ingest and lookups; each step is bounded (a stale drop rewrites the mask
        table, O(distinct holder sets); its rows are freed by :meth:`maintain` slices)."""
        now = self.clock() if now is None else now
        for slot, (_, deadline) in list(self._stale.items()):
            if deadline <= now:
                self._drop_stale(slot)
        self._pending.expire(now)
        self._orphans.expire(now)
        stale_due = min((d for _, d in self._stale.values()), default=float("inf"))
        self._due = min(stale_due, self._pending.next_deadline(), self._orphans.next_deadline())

    def maintain(self) -> int:
        """One bounded slice of housekeeping (freeing rows emptied by bulk clears). Returns rows
        freed. Ingest calls it; an idle controller may call it on a timer."""
        self._tick()
        return self._tree.sweep(self.sweep_rows, self.sweep_work)

    @property
    def needs_maintenance(self) -> bool:
        """Rows emptied by a bulk clear still wait for :meth:`maintain` slices, or a deadline
        (pending prompts, stale marks, orphan runs) passed: on an idle controller nothing else
        expires them, and a busy spell's pending prompts were kept for good."""
        return self._tree.garbage or self.clock() >= self._due

    # ---- stale marks -------------------------------------------------------------------------
    def mark_stale(self, instance_id: str) -> int:
        """Keep the instance's GPU entries but flag them stale (a silent instance, an event gap
        replay could not fill, a sink error). Lookups still credit them and report how much of
        each hit is stale; entries stored again turn fresh; the rest go after ``stale_ttl_s``.
        Marking again restarts the TTL. Returns entries newly marked."""
        slot = self._slot(instance_id)
        if slot is None:
            return 0
        tree = self._tree
        bit = 1 << slot
        st = self._stale.get(slot)
        sslot = st[0] if st is not None else self._alloc()
        sbit = 1 << sslot
        tree.stale_owner[sbit] = bit
        tree.stale_all |= sbit
        n = tree.count.get(bit, 0)
        tree.rewrite(0, bit, sbit)
        tree.count[sbit] = tree.count.get(sbit, 0) + n
        tree.count[bit] = 0
        self._stale[slot] = (sslot, self.clock() + self.stale_ttl_s)
        self._counts["gpu_marked_stale"] += n
        self._due = min(self._due, self._stale[slot][1])
        return n

    def is_stale(self, instance_id: str) -> bool:
        """Whether the instance has entries marked stale and not yet stored again or dropped."""
        slot = self._slots.get(instance_id)
        st = self._stale.get(slot) if slot is not None else None
        return st is not None and self._tree.count.get(1 << st[0], 0) > 0

    def stale_instances(self) -> list[str]:
        return [iid for iid in self._order if self.is_stale(iid)]

    def _drop_stale(self, slot: int) -> None:
        sslot, _ = self._stale.pop(slot)
        sbit = 1 << sslot
        tree = self._tree
        self._counts["gpu_stale_dropped"] += tree.count.get(sbit, 0)
        tree.stale_all &= ~sbit
        tree.stale_owner.pop(sbit, None)
        tree.rewrite(sbit)
        self._free(sslot)
        tree.sweep(self.sweep_rows, self.sweep_work)
        exc = self._exc.get(slot)
        if exc:  # keep only aliases of rows the instance still holds
            bit = 1 << slot
            self._exc[slot] = {e: h for e, h in exc.items() if tree.mask(tree.find(h)) & bit}

    # ---- GPU tier ----------------------------------------------------------------------------
    def root_for(self, model: str | None, base: int | None = None) -> int:
        """Chain root a route for ``model`` hashes under: the adapter's root when ``model`` names
        a LoRA adapter the engines reported (or :meth:`register_adapter` named), else the base
        root (``base``, default this index's ``fast_root``)."""
        base = self.fast_root if base is None else base
        if model and model in self._adapters:
            return adapter_root(base, model)
        return base

    def register_adapter(self, name: str) -> None:
        self._adapters.add(name)

    def _chain(self, token_ids: Sequence[int], root: int, lora_name: str | None,
               extra_keys: Sequence[Any] | None) -> list[int]:
        bs = self.block_size
        extras: list[tuple[Any, ...] | None] | None = None
        if extra_keys:
            extras = []
            for ek in extra_keys:
                if ek and lora_name is not None and ek[0] == lora_name:
                    ek = ek[1:]  # the adapter is in the root already
                extras.append(tuple(ek) if ek else None)
            if not any(extras):
                extras = None
        if extras is None:
            return fast_chain(token_ids, bs, root=root)
        out, h = [], root
        for j, ek in enumerate(extras):
            h = fast_chain(token_ids[j * bs:(j + 1) * bs], bs, root=h)[0]
            if ek:
                h = fold_extra(h, ek)
            out.append(h)
        return out

    def _resolve(self, slot: int, e: int, held: int) -> int:
        """Row of engine hash ``e`` as ``slot`` reported it, if the slot holds it (any bit in
        ``held``); 0 otherwise."""
        tree = self._tree
        exc = self._exc.get(slot)
        h = exc.get(e) if exc else None
        r = tree.find(h) if h is not None else tree.alias.find(e)
        if r and tree.mask(r) & held:
            return r
        if h is not None:
            del exc[e]  # type: ignore[union-attr]
        return 0

    def gpu_stored(
        self,
        instance_id: str,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        lora_id: int | None = None,
    ) -> int:
        """Apply a vLLM ``BlockStored``: re-hash its tokens into our chain. Returns blocks applied
        (blocks under a parent this instance is not known to hold are kept aside and count 0)."""
        self._tick()
        if block_size != self.block_size or len(token_ids) != len(block_hashes) * block_size:
            self._counts["bad_block_size"] += 1
            return 0
        if extra_keys is not None and len(extra_keys) != len(block_hashes):
            self._counts["bad_block_size"] += 1
            return 0
        slot = self._slot(instance_id)
        if slot is None:
            return 0
        if lora_name is None and lora_id is not None:
            lora_name = f"lora-id:{lora_id}"  # pre-0.11 engines: keeps adapters apart all the same
        if lora_name is not None:
            self._adapters.add(lora_name)
        if parent_block_hash is None:
            prow, root = 0, self.root_for(lora_name)
        else:
            bit, sbit = self._bits(slot)
            prow = self._resolve(slot, parent_block_hash, bit | sbit)
            if not prow:
                self._orphans.keep(slot, parent_block_hash,
                                   [list(block_hashes), None, list(token_ids), lora_name,
                                    None if extra_keys is None else list(extra_keys)], self.clock())
                self._due = min(self._due, self._orphans.next_deadline())
                return 0
            root = self._tree.key[prow]
        ours = self._chain(token_ids, root, lora_name, extra_keys)
        return self._store(slot, ours, prow, block_hashes)

    def gpu_stored_hashes(
        self,
        instance_id: str,
        hashes: Sequence[int],
        parent: int | None = None,
        *,
        engine_hashes: Sequence[int] | None = None,
    ) -> int:
        """Store a chain of blocks already in our hash space (the simulator's entry point)."""
        self._tick()
        slot = self._slot(instance_id)
        if slot is None:
            return 0
        prow = 0
        if parent is not None and parent != self.fast_root:
            bit, sbit = self._bits(slot)
            prow = self._tree.find(parent)
            if not prow or not self._tree.mask(prow) & (bit | sbit):
                self._orphans.keep(slot, parent, [None, list(hashes), None, None, None], self.clock())
                self._due = min(self._due, self._orphans.next_deadline())
                return 0
        return self._store(slot, hashes, prow, engine_hashes)

    def _store(self, slot: int, hashes: Sequence[int], prow: int, engine_hashes: Sequence[int] | None) -> int:
        tree = self._tree
        if tree.garbage:
            tree.sweep(self.sweep_rows, self.sweep_work)
        bit, sbit = self._bits(slot)
        exc = tree.store(bit, sbit, hashes, prow, engine_hashes)
        if exc:  # this engine hashes these tokens differently
            self._exc.setdefault(slot, {}).update(exc)
        if self._pending:
            self._pending.confirm(slot, hashes)
        self._counts["gpu_stored"] += len(hashes)
        if self._orphans.waiting(slot):
            # Replays store again and may free further runs: a work queue, not recursion, since
            # a gap can leave a chain of hundreds of runs (one per decode step) waiting.
            self._adoptable.append((slot, hashes, engine_hashes))
            if not self._adopting:
                self._adopting = True
                try:
                    while self._adoptable:
                        self._adopt(*self._adoptable.pop())
                finally:
                    self._adopting = False
        return len(hashes)

    def _adopt(self, slot: int, hashes: Sequence[int], engine_hashes: Sequence[int] | None) -> None:
        """Replay runs that were waiting for one of these blocks as their parent."""
        iid = self._order[self._pos[slot]]
        for h, e in zip(hashes, engine_hashes or [None] * len(hashes)):
            if not self._orphans.waiting(slot):
                return
            runs = self._orphans.take(slot, h)
            if e is not None:
                runs += self._orphans.take(slot, e)
            for run in runs:
                eng, ours, toks, lora, extra = run[:5]
                if eng is None:
                    self._store(slot, ours, self._tree.find(h), None)
                else:
                    self.gpu_stored(iid, eng, e, toks, self.block_size, lora_name=lora, extra_keys=extra)

    def gpu_removed(self, instance_id: str, block_hashes: Sequence[int]) -> int:
        """Apply a vLLM ``BlockRemoved`` (engine hashes). Returns blocks that were known."""
        self._tick()
        slot = self._slot(instance_id)
        if slot is None:
            return 0
        bit, sbit = self._bits(slot)
        tree = self._tree
        exc = self._exc.get(slot)
        if exc:  # aliases of its own: resolved one by one
            held = bit | sbit
            known = 0
            missing = []
            for e in block_hashes:
                r = self._resolve(slot, e, held)
                if r:
                    known += 1
                    tree.clear(r, bit, sbit)
                else:
                    missing.append(e)
        else:  # the shared map alone (the common case)
            known, missing = tree.remove_engine(block_hashes, bit, sbit)
        for e in missing:
            if self._orphans.removed(slot, e):
                known += 1
            else:
                self._counts["gpu_unknown_removed"] += 1
        self._counts["gpu_removed"] += known
        return known

    def gpu_removed_hashes(self, instance_id: str, hashes: Iterable[int]) -> int:
        """Remove blocks given in our hash space (the simulator's entry point)."""
        self._tick()
        slot = self._slot(instance_id)
        if slot is None:
            return 0
        bit, sbit = self._bits(slot)
        n = self._tree.remove_keys(hashes, bit, sbit)
        self._counts["gpu_removed"] += n
        return n

    def gpu_cleared(self, instance_id: str) -> None:
        """``AllBlocksCleared`` / engine restart / re-registration: the instance holds nothing on
        its GPU, stale entries and pending prompts included. O(distinct holder sets) now; the
        emptied rows are freed by later bounded slices."""
        slot = self._slots.get(instance_id)
        if slot is None:
            self._counts["unknown_instance"] += 1
            return
        tree = self._tree
        bit, sbit = self._bits(slot)
        tree.rewrite(bit | sbit)
        tree.count[bit] = 0
        if sbit:
            del self._stale[slot]
            tree.stale_all &= ~sbit
            tree.stale_owner.pop(sbit, None)
            tree.refold()
            self._free(sbit.bit_length() - 1)
        self._exc.pop(slot, None)
        self._orphans.drop_slot(slot)
        self._pending.drop_slot(slot)
        self._counts["gpu_cleared"] += 1
        tree.sweep(self.sweep_rows, self.sweep_work)  # a first bounded slice now: small indexes are clean at once

    # ---- pending (routed, not yet reported) ----------------------------------------------------
    def add_pending(self, instance_id: str, blocks: Sequence[int]) -> bool:
        """Count a prompt just routed to ``instance_id`` as held there until its engine stores
        the last block or ``pending_ttl_s`` passes. Returns False when nothing was pending (the
        instance already holds the whole prompt, or the prompt has no full block)."""
        slot = self._slots.get(instance_id)
        if slot is None or not blocks:
            return False
        bit, sbit = self._bits(slot)
        tree = self._tree
        if tree.mask(tree.find(blocks[-1])) & (bit | sbit):
            return False
        now = self.clock()
        self._pending.add(slot, blocks, now)
        self._due = min(self._due, now + self._pending.ttl_s)
        return True

    # ---- LMCache local tier --------------------------------------------------------------------
    def lmcache_admit(self, instance_id: str, chunk_hashes: Iterable[int]) -> None:
        slot = self._slot(instance_id)
        if slot is None:
            return
        bit = 1 << slot
        lmc = self._lmc
        n = 0
        for h in chunk_hashes:
            lmc[h] = lmc.get(h, 0) | bit
            n += 1
        self._counts["lmcache_admitted"] += n

    def lmcache_evict(self, instance_id: str, chunk_hashes: Iterable[int]) -> None:
        slot = self._slot(instance_id)
        if slot is None:
            return
        keep = ~(1 << slot)
        lmc = self._lmc
        n = 0
        for h in chunk_hashes:
            m = lmc.get(h)
            if m is None:
                continue
            m &= keep
            if m:
                lmc[h] = m
            else:
                del lmc[h]
            n += 1
        self._counts["lmcache_evicted"] += n

    def lmcache_cleared(self, instance_id: str) -> None:
        slot = self._slots.get(instance_id)
        if slot is None:
            return
        keep = ~(1 << slot)
        lmc = self._lmc
        for h in [h for h, m in lmc.items() if m & ~keep]:
            m = lmc[h] & keep
            if m:
                lmc[h] = m
            else:
                del lmc[h]

    def lmcache_worker_seen(self, instance_id: str) -> None:
        """Liveness is tracked by the controller; the index has nothing to do."""

    # ---- global tier -------------------------------------------------------------------------
    def global_stored(self, chunk_hashes: Iterable[int]) -> None:
        before = len(self._global)
        self._global.update(chunk_hashes)
        self._counts["global_stored"] += len(self._global) - before

    def global_removed(self, chunk_hashes: Iterable[int]) -> None:
        before = len(self._global)
        self._global.difference_update(chunk_hashes)
        self._counts["global_removed"] += before - len(self._global)

    def global_reset(self, chunk_hashes: Iterable[int]) -> None:
        self._global = set(chunk_hashes)
        self._counts["global_resets"] += 1

    def global_contains(self, chunk_hash: int) -> bool:
        return chunk_hash in self._global

    # ---- queries -----------------------------------------------------------------------------
    def lookup(self, blocks: Sequence[int], chunks: Sequence[int] | None = None) -> Lookup:
        """Every instance's contiguous hit for a prompt given as its chains of block/chunk hashes."""
        if self.clock() >= self._due:
            self.expire()
        tree = self._tree
        rows = tree.rows
        gpu = bisect(blocks, rows, tree.mid, tree.view, tree.run)
        fresh = bisect(blocks, rows, tree.mid, tree.fresh, tree.run) if tree.fresh is not None and gpu else None
        pending = self._pending.credits(blocks) if self._pending else []
        lmc: Groups = []
        g = 0
        if chunks:
            lmc = walk(chunks, self._lmc.get)
            glob = self._global
            for h in chunks:
                if h not in glob:
                    break
                g += 1
        return Lookup(gpu, fresh, lmc, pending, g, self.block_size, self.chunk_size, self._pos, self._order_slots,
                      self._all_mask)

    # ---- introspection -------------------------------------------------------------------------
    def gpu_blocks_of(self, instance_id: str) -> int:
        """GPU blocks the instance holds (fresh and stale)."""
        slot = self._slots.get(instance_id)
        if slot is None:
            return 0
        bit, sbit = self._bits(slot)
        count = self._tree.count
        return count.get(bit, 0) + (count.get(sbit, 0) if sbit else 0)

    def gpu_block_counts(self) -> dict[str, int]:
        return {iid: self.gpu_blocks_of(iid) for iid in self._order}

    def sizes(self) -> dict[str, int]:
        return {
            "gpu_nodes": self._tree.nodes,
            "gpu_aliases": self._tree.alias.n + sum(len(x) for x in self._exc.values()),
            "lmcache_chunks": len(self._lmc),
            "global_chunks": len(self._global),
        }

    # ---- export (snapshots: smetric_lmc.index.snapshot restores through the public API) ----------
    def export_instance(self, instance_id: str) -> dict[str, Any]:
        """What ``instance_id`` holds, as plain arrays: GPU rows parallel in ``hash`` (our chain
        hash), ``parent`` (the parent's hash; 0 under a chain root), ``eng`` (the engine hash it
        reported; 0: none) and ``stale``; and its LMCache ``chunks``. Pending prompts and orphans
        are transient and left out. Empty arrays for an unknown instance."""
        slot = self._slots.get(instance_id)
        tree = self._tree
        if slot is None:
            rows = np.zeros(0, dtype=np.int64)
            sbit = 0
        else:
            bit, sbit = self._bits(slot)
            held = np.fromiter((bool(m & (bit | sbit)) for m in tree.mval), dtype=bool, count=len(tree.mval))
            mid = np.frombuffer(tree.mid, dtype=np.uint32)
            rows = np.flatnonzero(held[mid])
            rows = rows[rows > 0]
        key = np.frombuffer(tree.key, dtype=np.uint64)
        hashes = key[rows]
        eng = np.frombuffer(tree.eng, dtype=np.uint64)[rows].copy()
        exc = self._exc.get(slot) if slot is not None else None
        if exc:  # this instance's own engine hashes where they differ from the shared ones
            pos = {int(h): i for i, h in enumerate(hashes)}
            for e, h in exc.items():
                i = pos.get(h)
                if i is not None:
                    eng[i] = e
        stale = np.zeros(len(rows), dtype=bool)
        if sbit:
            sheld = np.fromiter((bool(m & sbit) for m in tree.mval), dtype=bool, count=len(tree.mval))
            stale = sheld[np.frombuffer(tree.mid, dtype=np.uint32)[rows]]
        chunks = np.zeros(0, dtype=np.uint64)
        if slot is not None:
            b = 1 << slot
            chunks = np.fromiter((h for h, m in self._lmc.items() if m & b), dtype=np.uint64)
        return {
            "hash": hashes.copy(),
            "parent": key[np.frombuffer(tree.par, dtype=np.uint32)[rows]].copy(),
            "eng": eng,
            "stale": stale,
            "chunks": chunks,
        }

    def export_global(self) -> np.ndarray:
        """The global tier's chunk hashes."""
        return np.fromiter(self._global, dtype=np.uint64, count=len(self._global))
