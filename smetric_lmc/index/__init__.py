"""Two-tier KV index: which instance holds which prefix blocks, in which tier.

Three hash spaces are kept apart:

* **GPU tier** — vLLM blocks, keyed by the controller's own fast chain (``hashing.fast_chain``) at
  the engines' block size. vLLM's ``BlockStored`` carries the token ids, so each stored block is
  re-hashed once and the engine's hash is kept as an alias for ``BlockRemoved`` (hashes only) and
  ``parent_block_hash``. Aliases are per instance: one shared engine-hash -> block map plus, per
  instance, the hashes that differ from it (another ``PYTHONHASHSEED``, another
  ``--prefix-caching-hash-algo``), so every engine resolves its own removals and parents.
* **LMCache local tier** — LMCache chunk hashes (256 tokens by default) reported by LMCache workers.
* **Global tier** — LMCache chunk hashes present in Mooncake Store / Redis.

LoRA adapters and extra keys. A ``BlockStored`` with ``lora_name`` chains from the adapter's root,
``adapter_root(fast_root, lora_name)``, so blocks of different adapters (and of the base model)
never meet. Route requests get the same chain by hashing under ``root_for(model)``: a route's
``model`` that names an adapter the engines reported (or one given to ``register_adapter``) maps to
that adapter's root, any other model to the base root. Per-block ``extra_keys`` other than the
adapter name (multimodal ids, cache salt, prompt-embedding digests) are folded into that block's
hash (``fold_extra``): such blocks only ever match each other, never a plain-token prompt.

Contract (DESIGN §6):

* Completeness: a GPU block counts for an instance only while the instance holds every ancestor
  (a prefix cache hits contiguously from the root). Removing a block takes its descendants with
  it for that instance.
* Orphans: a ``BlockStored`` under a parent the instance is not known to hold is kept aside
  (``gpu_orphans``), not refused, and replayed when that instance stores the parent
  (``gpu_orphans_adopted``); runs still waiting after ``orphan_ttl_s`` or beyond
  ``orphan_cap_blocks`` per instance are dropped (``gpu_orphans_dropped``).
* Stale: ``mark_stale(instance)`` keeps its GPU entries but flags them. Lookups still credit them
  and ``Lookup.stale_hit_tokens()`` says how much of each instance's hit is stale; entries stored
  again are fresh (a store also refreshes its ancestors: the engine just used them); entries not
  stored again within ``stale_ttl_s`` are dropped (``gpu_stale_dropped``). ``gpu_cleared`` and
  ``drop_instance`` clear for real. Bulk changes cost O(distinct holder sets) at once, and the rows
  they empty are freed in bounded slices (``maintain``), never in one long pass.
* Pending: ``add_pending(instance, blocks)`` (the router calls it for the chosen instance) credits
  the routed prompt to that instance for any lookup whose prompt extends it, until the engine
  stores the prompt's last block (``pending_confirmed``) or ``pending_ttl_s`` passes
  (``pending_expired``). Deadlines use the ``clock`` given to the constructor (the simulator
  passes its virtual clock).

API: ``register_instance``, ``drop_instance``, ``instances``; GPU tier ``gpu_stored`` (vLLM events,
with ``lora_name`` / ``extra_keys`` / ``lora_id``), ``gpu_stored_hashes`` / ``gpu_removed_hashes``
(our hash space: the simulator), ``gpu_removed``, ``gpu_cleared``, ``mark_stale``, ``is_stale``,
``stale_instances``, ``add_pending``, ``root_for``, ``register_adapter``; LMCache tier
``lmcache_admit`` / ``lmcache_evict`` / ``lmcache_cleared``; global tier ``global_stored`` /
``global_removed`` / ``global_reset`` / ``global_contains``; ``lookup(blocks, chunks) -> Lookup``
(``best()`` and ``at(i)``: the longest local hit with its holders and one instance's hit, in
O(distinct hit lengths), as a route asks; per-instance lists ``local_hit_tokens()``,
``gpu_blocks``, ``lmcache_chunks``, ``stale_hit_tokens()``; ``global_hit_tokens``); upkeep ``expire`` / ``maintain``; introspection ``gpu_blocks_of``,
``gpu_block_counts``, ``sizes``, ``stats``.

Storage (see ``tree``): GPU blocks are rows of array columns behind an open-addressing map, holder
masks are interned ids (bytes per block: ``bench/peers.py``, docs/measurements.md). A lookup
finds every instance's hit length over monotone masks, probing first where each run was stored to
end, then by bisection: O(distinct hit lengths x log n) probes at worst. The
LMCache spaces learn no parent links and LRU evicts a sequence's first chunks first, so their
lookups walk the chain (chunks are 16x coarser). LMCache's own controller credits a chunk to its
first registered holder only; here every holder is kept, so each instance's prefix is exact.
Hash value 0 is reserved (an empty slot) and never matches.
"""

from smetric_lmc.index.lookup import Lookup
from smetric_lmc.index.tier import TierIndex, adapter_root, fold_extra

__all__ = ["Lookup", "TierIndex", "adapter_root", "fold_extra"]
