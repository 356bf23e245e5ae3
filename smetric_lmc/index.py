"""Two-tier KV index: which instance holds which prefix blocks, in which tier.

Three hash spaces are kept apart:

* **GPU tier** — vLLM blocks, keyed by the controller's own fast chain (``hashing.fast_chain``) at
  the engines' block size. vLLM's ``BlockStored`` carries the token ids, so each stored block is
  re-hashed once; ``alias`` maps the engine's hash to ours so ``BlockRemoved`` (hashes only) and
  ``parent_block_hash`` resolve. Engines with different hash seeds or algorithms therefore share
  one index, and a route request only needs the cheap fast chain.
* **LMCache local tier** — LMCache chunk hashes (256 tokens by default) reported by LMCache workers.
* **Global tier** — LMCache chunk hashes present in Mooncake Store / Redis.

Each entry holds a bit mask of instance *slots*. In the GPU space the mask is *complete*: a slot's
bit is set on a block only while the slot also holds every ancestor, because a prefix cache can
only hit contiguously from the root. Storing under a missing parent is refused (counted as an
orphan) and removing a block clears the slot's bit from its descendants too. Masks are therefore
monotone along any chain, and a lookup finds every slot's hit length by bisection in
O(distinct hit lengths x log n) dictionary probes instead of walking the whole prompt.

The LMCache spaces learn no parent links from their sources and LRU there evicts a sequence's
oldest (= first) chunks first, so holes are common: their lookups walk the chain (chunks are 16x
coarser, so a 32k-token prompt is 128 probes).

LMCache's own controller credits a chunk to the first registered holder only; here every holder's
bit is kept, so each instance's longest prefix is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from smetric_lmc.hashing import FAST_ROOT, fast_chain

Groups = list[tuple[int, int]]  # (slot mask, hit length): disjoint masks, one per distinct hit


class Lookup:
    """Result of a prefix lookup. Per-instance lists are indexed like ``TierIndex.instances``."""

    __slots__ = ("local_tokens", "global_chunks", "block_size", "chunk_size", "_gpu", "_lmc", "_pos", "_n", "_all")

    def __init__(self, local_tokens: list[int], gpu: Groups, lmc: Groups, global_chunks: int,
                 block_size: int, chunk_size: int, pos: dict[int, int], n: int, all_mask: int) -> None:
        self.local_tokens = local_tokens  # per instance: max of its GPU hit and its LMCache local hit
        self.global_chunks = global_chunks
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._gpu, self._lmc, self._pos, self._n, self._all = gpu, lmc, pos, n, all_mask

    def local_hit_tokens(self) -> list[int]:
        return self.local_tokens

    @property
    def gpu_blocks(self) -> list[int]:
        return _expand(self._gpu, 1, self._pos, self._n, self._all)

    @property
    def lmcache_chunks(self) -> list[int]:
        return _expand(self._lmc, 1, self._pos, self._n, self._all)

    @property
    def global_hit_tokens(self) -> int:
        return self.global_chunks * self.chunk_size


class TierIndex:
    """Event-driven index of the local (GPU, LMCache) and global tiers of every instance."""

    def __init__(self, block_size: int = 16, chunk_size: int = 256, *, fast_root: int = FAST_ROOT) -> None:
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.fast_root = fast_root
        self._slots: dict[str, int] = {}
        self._ids: list[str | None] = []  # slot -> instance id
        # The GPU-space tree lives in dicts of plain ints, which the garbage collector does not
        # track: a million per-block objects would make every full collection a long pause.
        self._mask: dict[int, int] = {}  # our block hash -> complete slot mask (the node set)
        self._parent: dict[int, int] = {}  # block -> parent block (absent at the root)
        self._kid: dict[int, int] = {}  # block -> first child
        self._more_kids: dict[int, list[int]] = {}  # block -> further children (branch points only)
        self._engine: dict[int, int] = {}  # our block hash -> engine hash that stored it first
        self._slot_blocks: dict[int, int] = {}  # slot -> GPU blocks it holds
        self._alias: dict[int, int] = {}  # engine block hash -> our hash
        self._lmc: dict[int, int] = {}  # chunk hash -> slot mask
        self._global: set[int] = set()
        self._order: list[str] = []  # instance ids in registration order (the view's order)
        self._order_slots: list[int] = []
        self._pos: dict[int, int] = {}  # slot -> position in _order
        self._all_mask = 0  # bits of every registered slot
        self.stats: dict[str, int] = {
            "gpu_stored": 0,
            "gpu_removed": 0,
            "gpu_orphans": 0,
            "gpu_unknown_removed": 0,
            "gpu_cleared": 0,
            "lmcache_admitted": 0,
            "lmcache_evicted": 0,
            "global_stored": 0,
            "global_removed": 0,
            "global_resets": 0,
            "unknown_instance": 0,
            "bad_block_size": 0,
        }

    # ---- instances -------------------------------------------------------------------------
    @property
    def instances(self) -> list[str]:
        """Registered instances, in the order every per-instance list of a Lookup uses."""
        return self._order

    def register_instance(self, instance_id: str) -> int:
        """Give an instance a slot (idempotent). Returns the slot."""
        slot = self._slots.get(instance_id)
        if slot is not None:
            return slot
        try:
            slot = self._ids.index(None)
            self._ids[slot] = instance_id
        except ValueError:
            slot = len(self._ids)
            self._ids.append(instance_id)
        self._slots[instance_id] = slot
        self._order.append(instance_id)
        self._order_slots.append(slot)
        self._pos[slot] = len(self._order) - 1
        self._all_mask |= 1 << slot
        return slot

    def drop_instance(self, instance_id: str) -> None:
        """Forget an instance and everything it held."""
        if instance_id not in self._slots:
            return
        self.gpu_cleared(instance_id)
        self.lmcache_cleared(instance_id)
        slot = self._slots.pop(instance_id)
        self._slot_blocks.pop(slot, None)
        self._ids[slot] = None
        i = self._order.index(instance_id)
        del self._order[i]
        del self._order_slots[i]
        self._pos = {sl: k for k, sl in enumerate(self._order_slots)}
        self._all_mask &= ~(1 << slot)

    def _slot(self, instance_id: str) -> int | None:
        slot = self._slots.get(instance_id)
        if slot is None:
            self.stats["unknown_instance"] += 1
        return slot

    # ---- GPU tier ----------------------------------------------------------------------------
    def gpu_stored(
        self,
        instance_id: str,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> int:
        """Apply a vLLM ``BlockStored``: re-hash its tokens into our chain. Returns blocks applied."""
        if block_size != self.block_size or len(token_ids) != len(block_hashes) * block_size:
            self.stats["bad_block_size"] += 1
            return 0
        if parent_block_hash is None:
            parent = self.fast_root
        else:
            parent = self._alias.get(parent_block_hash)
            if parent is None:  # missed the parent's event: cannot place these blocks
                self.stats["gpu_orphans"] += len(block_hashes)
                return 0
        ours = fast_chain(token_ids, block_size, root=parent)
        return self.gpu_stored_hashes(instance_id, ours, parent, engine_hashes=block_hashes)

    def gpu_stored_hashes(
        self,
        instance_id: str,
        hashes: Sequence[int],
        parent: int | None = None,
        *,
        engine_hashes: Sequence[int] | None = None,
    ) -> int:
        """Store a chain of blocks already in our hash space (the simulator's entry point)."""
        slot = self._slot(instance_id)
        if slot is None:
            return 0
        bit = 1 << slot
        masks, parents, kid = self._mask, self._parent, self._kid
        root = self.fast_root
        prev = root if parent is None else parent
        if prev != root and not masks.get(prev, 0) & bit:
            self.stats["gpu_orphans"] += len(hashes)
            return 0
        added = 0
        for j, h in enumerate(hashes):
            m = masks.get(h)
            if m is None:
                m = 0
                if prev != root:
                    parents[h] = prev
                    if prev in kid:
                        self._more_kids.setdefault(prev, []).append(h)
                    else:
                        kid[prev] = h
                if engine_hashes is not None:
                    self._engine[h] = engine_hashes[j]
                    self._alias[engine_hashes[j]] = h
            elif engine_hashes is not None and h not in self._engine:
                self._engine[h] = engine_hashes[j]
                self._alias[engine_hashes[j]] = h
            if not m & bit:
                added += 1
                masks[h] = m | bit
            prev = h
        self._slot_blocks[slot] = self._slot_blocks.get(slot, 0) + added
        self.stats["gpu_stored"] += len(hashes)
        return len(hashes)

    def gpu_removed(self, instance_id: str, block_hashes: Sequence[int]) -> int:
        """Apply a vLLM ``BlockRemoved`` (engine hashes). Returns blocks that were known."""
        slot = self._slot(instance_id)
        if slot is None:
            return 0
        known = 0
        alias = self._alias
        for eh in block_hashes:
            h = alias.get(eh)
            if h is None:
                self.stats["gpu_unknown_removed"] += 1
                continue
            known += 1
            self._clear_subtree(h, slot)
        self.stats["gpu_removed"] += known
        return known

    def gpu_removed_hashes(self, instance_id: str, hashes: Iterable[int]) -> int:
        """Remove blocks given in our hash space (the simulator's entry point)."""
        slot = self._slot(instance_id)
        if slot is None:
            return 0
        n = 0
        for h in hashes:
            if h in self._mask:
                self._clear_subtree(h, slot)
                n += 1
        self.stats["gpu_removed"] += n
        return n

    def _children(self, h: int) -> list[int]:
        first = self._kid.get(h)
        if first is None:
            return []
        return [first, *self._more_kids.get(h, ())]

    def _clear_subtree(self, h: int, slot: int) -> None:
        # A block the slot no longer holds cuts its contiguous prefix: descendants go with it.
        masks = self._mask
        bit = 1 << slot
        cleared = 0
        stack = [h]
        while stack:
            x = stack.pop()
            m = masks.get(x, 0)
            if not m & bit:
                continue
            stack.extend(self._children(x))
            cleared += 1
            m &= ~bit
            if m:
                masks[x] = m
            else:
                self._delete_node(x)
        if cleared:
            self._slot_blocks[slot] -= cleared

    def _delete_node(self, h: int) -> None:
        # mask == 0 implies every descendant's mask is 0 too, so they are deleted by the same sweep.
        del self._mask[h]
        self._kid.pop(h, None)
        self._more_kids.pop(h, None)
        eh = self._engine.pop(h, None)
        if eh is not None and self._alias.get(eh) == h:
            del self._alias[eh]
        p = self._parent.pop(h, None)
        if p is None:
            return
        extra = self._more_kids.get(p)
        if self._kid.get(p) == h:
            if extra:
                self._kid[p] = extra.pop()
            else:
                self._kid.pop(p, None)
        elif extra and h in extra:
            extra.remove(h)
        if extra is not None and not extra:
            del self._more_kids[p]

    def gpu_cleared(self, instance_id: str) -> None:
        """``AllBlocksCleared`` / engine restart: the instance holds nothing on its GPU."""
        slot = self._slots.get(instance_id)
        if slot is None:
            self.stats["unknown_instance"] += 1
            return
        bit = 1 << slot
        masks = self._mask
        dead = []
        for h, m in masks.items():
            if m & bit:
                m &= ~bit
                masks[h] = m  # replacing a value while iterating is safe; resizing is not
                if not m:
                    dead.append(h)
        for h in dead:
            self._delete_node(h)
        self._slot_blocks[slot] = 0
        self.stats["gpu_cleared"] += 1

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
        self.stats["lmcache_admitted"] += n

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
        self.stats["lmcache_evicted"] += n

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
        self.stats["global_stored"] += len(self._global) - before

    def global_removed(self, chunk_hashes: Iterable[int]) -> None:
        before = len(self._global)
        self._global.difference_update(chunk_hashes)
        self.stats["global_removed"] += before - len(self._global)

    def global_reset(self, chunk_hashes: Iterable[int]) -> None:
        self._global = set(chunk_hashes)
        self.stats["global_resets"] += 1

    def global_contains(self, chunk_hash: int) -> bool:
        return chunk_hash in self._global

    # ---- queries -----------------------------------------------------------------------------
    def lookup(self, blocks: Sequence[int], chunks: Sequence[int] | None = None) -> Lookup:
        """Every instance's contiguous hit for a prompt given as its chains of block/chunk hashes."""
        n = len(self._order)
        pos = self._pos
        bs, cs = self.block_size, self.chunk_size
        gpu = self._gpu_hits(blocks)
        local = _expand(gpu, bs, pos, n, self._all_mask)
        lmc: Groups = []
        g = 0
        if chunks:
            lmc = self._lmcache_hits(chunks)
            if lmc:
                local = [max(a, b) for a, b in zip(local, _expand(lmc, cs, pos, n, self._all_mask))]
            glob = self._global
            for h in chunks:
                if h not in glob:
                    break
                g += 1
        return Lookup(local, gpu, lmc, g, bs, cs, pos, n, self._all_mask)

    def _gpu_hits(self, chain: Sequence[int]) -> Groups:
        """Slots grouped by number of leading blocks held, by bisection over monotone masks."""
        n = len(chain)
        if n == 0:
            return []
        get = self._mask.get
        first = get(chain[0], 0)
        if not first:
            return []
        last = get(chain[n - 1], 0)
        groups: Groups = [(last, n)] if last else []
        # Invariant of each pending range (lo, hi): mask(lo) = mlo, mask(hi) = mhi, mlo ⊋ mhi.
        # Slots in mlo & ~mhi drop out somewhere in (lo, hi]; split until ranges are unit-wide.
        stack = [(0, first, n - 1, last)] if first != last else []
        pop, push = stack.pop, stack.append
        while stack:
            lo, mlo, hi, mhi = pop()
            if hi - lo == 1:
                groups.append((mlo & ~mhi, hi))
                continue
            mid = (lo + hi) >> 1
            mm = get(chain[mid], 0)
            if mm != mlo:
                push((lo, mlo, mid, mm))
            if mm != mhi:
                push((mid, mm, hi, mhi))
        return groups

    def _lmcache_hits(self, chain: Sequence[int]) -> Groups:
        """Slots grouped by leading chunks held, walking the chain (these spaces can have holes)."""
        groups: Groups = []
        get = self._lmc.get
        alive = get(chain[0], 0)
        if not alive:
            return groups
        for j in range(1, len(chain)):
            m = get(chain[j], 0) & alive
            if m != alive:
                groups.append((alive & ~m, j))
                alive = m
                if not alive:
                    return groups
        groups.append((alive, len(chain)))
        return groups

    # ---- introspection -------------------------------------------------------------------------
    def gpu_blocks_of(self, instance_id: str) -> int:
        slot = self._slots.get(instance_id)
        return 0 if slot is None else self._slot_blocks.get(slot, 0)

    def gpu_block_counts(self) -> dict[str, int]:
        return {iid: self._slot_blocks.get(self._slots[iid], 0) for iid in self._order}

    def sizes(self) -> dict[str, int]:
        return {
            "gpu_nodes": len(self._mask),
            "gpu_aliases": len(self._alias),
            "lmcache_chunks": len(self._lmc),
            "global_chunks": len(self._global),
        }

def _expand(groups: Groups, scale: int, pos: dict[int, int], n: int, all_mask: int) -> list[int]:
    """Per-instance list from hit groups. Starts from the largest group's value so the Python-level
    work is proportional to the instances *outside* it (64 instances sharing a system prompt cost
    one list multiplication, not 64 stores)."""
    if not groups:
        return [0] * n
    big_mask, big_val = max(groups, key=lambda g: g[0].bit_count())
    covered = 0
    for m, _ in groups:
        covered |= m
    if big_mask.bit_count() * 2 < n:  # sparse: most instances hit nothing
        out = [0] * n
        rest = groups
    else:
        out = [big_val * scale] * n
        rest = [g for g in groups if g[0] != big_mask]
        missing = all_mask & ~covered
        if missing:
            rest.append((missing, 0))
    for mask, val in rest:
        v = val * scale
        while mask:
            low = mask & -mask
            out[pos[low.bit_length() - 1]] = v
            mask ^= low
    return out
