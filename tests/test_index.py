"""TierIndex: per-instance contiguous hits per tier, checked against a naive model and real frames."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from index_helpers import Naive, path_to, random_tree

from smetric_lmc.controller.vllm_plan import apply_batch
from smetric_lmc.controller.vllm_wire import BlockStored, EventBatch
from smetric_lmc.hashing import fast_chain
from smetric_lmc.index import TierIndex, adapter_root, fold_extra


def make(n=3, bs=16, cs=64):
    ix = TierIndex(bs, cs)
    for k in range(n):
        ix.register_instance(f"i{k}")
    return ix


def test_gpu_hit_is_contiguous_and_per_instance():
    ix = make()
    toks = list(range(160))
    ix.gpu_stored("i0", list(range(100, 110)), None, toks, 16)
    ix.gpu_stored("i1", list(range(100, 105)), None, toks[:80], 16)
    chain = fast_chain(toks, 16)
    assert ix.lookup(chain).local_hit_tokens() == [160, 80, 0]
    ix.gpu_removed("i0", [103])  # engine hash of block 3: blocks 3.. no longer hit on i0
    assert ix.lookup(chain).local_hit_tokens() == [48, 80, 0]
    ix.gpu_cleared("i1")
    assert ix.lookup(chain).local_hit_tokens() == [48, 0, 0]


def test_every_holder_is_credited_not_only_the_first():
    # LMCache's own controller credits a chunk to its first registered holder; we keep them all.
    ix = make()
    ix.lmcache_admit("i0", [1, 2])
    ix.lmcache_admit("i2", [1, 2, 3])
    found = ix.lookup([5], [1, 2, 3, 4])
    assert found.lmcache_chunks == [2, 0, 3]
    assert found.local_hit_tokens() == [128, 0, 192]


def test_lmcache_holes_stop_the_hit():
    ix = make()
    ix.lmcache_admit("i0", [2, 3])  # chunk 1 evicted first (LRU evicts the oldest = leading chunks)
    ix.lmcache_admit("i1", [1, 2, 3])
    ix.lmcache_evict("i1", [2])
    assert ix.lookup([], [1, 2, 3]).lmcache_chunks == [0, 1, 0]


def test_local_hit_is_max_of_gpu_and_lmcache():
    ix = make()
    toks = list(range(64))
    ix.gpu_stored("i0", [7, 8], None, toks[:32], 16)
    ix.lmcache_admit("i0", [11])
    found = ix.lookup(fast_chain(toks, 16), [11])
    assert found.at(0) == 64 and found.best() == (64, [0])  # sparse, before the dense list exists
    assert found.gpu_blocks[0] == 2 and found.lmcache_chunks[0] == 1
    assert found.local_hit_tokens()[0] == 64
    ix.lmcache_admit("i2", [11])  # an LMCache-only holder of the same length ties with i0
    found = ix.lookup(fast_chain(toks, 16), [11])
    assert found.best() == (64, [0, 2]) and found.at(2) == 64 and found.at(1) == 0


def test_global_tier_contiguous():
    ix = make()
    ix.global_stored([1, 2, 4])
    assert ix.lookup([], [1, 2, 3, 4]).global_hit_tokens == 128
    ix.global_removed([1])
    assert ix.lookup([], [1, 2]).global_chunks == 0
    ix.global_reset([1, 2, 3])
    assert ix.lookup([], [1, 2, 3, 4]).global_chunks == 3


def test_unknown_instances_and_bad_blocks_are_counted_not_applied():
    ix = make()
    assert ix.gpu_stored("nope", [5], None, list(range(16)), 16) == 0
    assert ix.stats["unknown_instance"] == 1
    assert ix.gpu_stored("i0", [5], None, list(range(15)), 16) == 0  # tokens do not fill the block
    assert ix.stats["bad_block_size"] == 1


# ---- issue: engine-hash aliases per instance; LoRA / extra keys ---------------------------------
def test_engine_hash_aliases_are_kept_per_instance():
    """Two engines hash the same tokens differently (another PYTHONHASHSEED or hash algo): each
    resolves its own parent links and removals."""
    ix = make()
    toks = list(range(64))
    chain = fast_chain(toks, 16)
    ix.gpu_stored("i0", [100, 101], None, toks[:32], 16)
    ix.gpu_stored("i1", [200, 201], None, toks[:32], 16)
    ix.gpu_stored("i1", [202, 203], 201, toks[32:], 16)  # parent given in i1's own hash space
    assert ix.lookup(chain).gpu_blocks == [2, 4, 0]
    assert ix.gpu_removed("i1", [201]) == 1  # i1's removal of its block 1 cuts its blocks 1..3
    assert ix.lookup(chain).gpu_blocks == [2, 1, 0]
    assert ix.stats["gpu_unknown_removed"] == 0
    ix.gpu_removed("i0", [200])  # another engine's hash means nothing for i0
    assert ix.lookup(chain).gpu_blocks == [2, 1, 0]
    ix.gpu_removed("i0", [100])
    assert ix.lookup(chain).gpu_blocks == [0, 1, 0]


def test_lora_adapters_never_share_blocks_and_routes_find_their_adapter():
    ix = make()
    toks = list(range(64))
    ix.gpu_stored("i0", [1, 2, 3, 4], None, toks, 16, lora_name="sql-lora")
    ix.gpu_stored("i1", [5, 6, 7, 8], None, toks, 16)
    ix.gpu_stored("i2", [9, 10, 11, 12], None, toks, 16, lora_name="chat-lora")
    base = fast_chain(toks, 16, root=ix.root_for("base-model"))
    sql = fast_chain(toks, 16, root=ix.root_for("sql-lora"))
    assert ix.lookup(base).gpu_blocks == [0, 4, 0]
    assert ix.lookup(sql).gpu_blocks == [4, 0, 0]
    assert ix.root_for("sql-lora") == adapter_root(ix.fast_root, "sql-lora") != ix.fast_root
    # the adapter's chain continues under its parent like any other
    ix.gpu_stored("i0", [13], 4, list(range(64, 80)), 16, lora_name="sql-lora")
    assert ix.lookup(fast_chain(list(range(80)), 16, root=ix.root_for("sql-lora"))).gpu_blocks == [5, 0, 0]


def test_lora_events_from_the_wire_land_in_the_adapters_chain():
    ix = make(2)
    toks = list(range(32))
    ev = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=toks, block_size=16,
                     lora_name="sql-lora", extra_keys=[("sql-lora",), ("sql-lora",)])
    apply_batch(EventBatch(ts=0.0, events=[ev]), ix, "i0")
    assert ix.lookup(fast_chain(toks, 16, root=ix.fast_root)).gpu_blocks == [0, 0]
    assert ix.lookup(fast_chain(toks, 16, root=ix.root_for("sql-lora"))).gpu_blocks == [2, 0]


def test_extra_keys_keep_multimodal_blocks_apart():
    ix = make()
    toks = list(range(32))
    ix.gpu_stored("i0", [1, 2], None, toks, 16, extra_keys=[("img-a", 0), None])
    ix.gpu_stored("i1", [3, 4], None, toks, 16, extra_keys=[("img-b", 0), None])
    ix.gpu_stored("i2", [5, 6], None, toks, 16)
    assert ix.lookup(fast_chain(toks, 16)).gpu_blocks == [0, 0, 2]
    h0 = fold_extra(fast_chain(toks[:16], 16)[0], ("img-a", 0))
    assert ix.lookup([h0, fast_chain(toks[16:], 16, root=h0)[0]]).gpu_blocks == [2, 0, 0]


# ---- issue: wipes that can be undone --------------------------------------------------------
def clocked(n=2, **kw):
    clock = [0.0]
    ix = TierIndex(16, 64, clock=lambda: clock[0], **kw)
    for k in range(n):
        ix.register_instance(f"i{k}")
    return ix, clock


def test_marked_stale_entries_are_still_credited_and_reported():
    ix, clock = clocked(stale_ttl_s=60)
    toks = list(range(96))
    chain = fast_chain(toks, 16)
    ix.gpu_stored("i0", [1, 2, 3, 4], None, toks[:64], 16)
    ix.gpu_stored("i1", [1, 2], None, toks[:32], 16)
    assert ix.mark_stale("i0") == 4
    assert ix.is_stale("i0") and ix.stale_instances() == ["i0"]
    found = ix.lookup(chain)
    assert found.local_hit_tokens() == [64, 32]
    assert found.stale_hit_tokens() == [64, 0]
    # the engine stores a new block under block 3: blocks 0..4 are all fresh again
    ix.gpu_stored("i0", [5], 4, toks[64:80], 16)
    found = ix.lookup(chain)
    assert found.gpu_blocks == [5, 2] and found.stale_hit_tokens() == [0, 0]
    assert not ix.is_stale("i0")
    # a removal still cuts the prefix, stale or not
    ix.mark_stale("i0")
    ix.gpu_removed("i0", [3])
    assert ix.lookup(chain).gpu_blocks == [2, 2]


def test_stale_entries_not_stored_again_are_dropped_after_the_ttl():
    ix, clock = clocked(stale_ttl_s=60, sweep_rows=2)
    toks = list(range(96))
    ix.gpu_stored("i0", [1, 2, 3], None, toks[:48], 16)
    other = list(range(1000, 1064))
    ix.gpu_stored("i0", [7, 8, 9, 10], None, other, 16)
    ix.mark_stale("i0")
    clock[0] = 30
    ix.gpu_stored("i0", [7, 8], None, other[:32], 16)  # re-stored: fresh
    clock[0] = 61
    assert ix.lookup(fast_chain(toks, 16)).gpu_blocks == [0, 0]
    assert ix.lookup(fast_chain(other, 16)).gpu_blocks == [2, 0]
    assert ix.stats["gpu_stale_dropped"] == 5 and ix.gpu_blocks_of("i0") == 2
    # the emptied rows are freed a bounded slice at a time, never in one pass
    assert ix.sizes()["gpu_nodes"] > 2
    while ix.needs_maintenance:  # what the controller's maintenance loop does
        ix.maintain()
    assert ix.sizes()["gpu_nodes"] == 2


def test_a_cleared_long_chain_is_freed_a_bounded_slice_at_a_time():
    """One garbage chain far longer than a slice's work: each slice frees at most its budget, a
    store that takes part of the chain back mid-sweep keeps those rows, the rest all go."""
    ix = TierIndex(16, 16, sweep_work=100)
    for i in ("a", "b"):
        ix.register_instance(i)
    chain = list(range(1, 2001))
    ix.gpu_stored_hashes("a", chain)
    ix.gpu_cleared("a")  # the first slice runs inside the clear: it walks down the chain
    assert ix.sizes()["gpu_nodes"] == 2000 and ix.needs_maintenance
    slices, taken_back = 1, False
    while ix.needs_maintenance:
        before = ix.sizes()["gpu_nodes"]
        ix.maintain()
        slices += 1
        assert before - ix.sizes()["gpu_nodes"] <= 100
        if not taken_back and ix.sizes()["gpu_nodes"] < 1000:  # the chain's top is still there
            ix.gpu_stored_hashes("b", chain[:50])  # b stores the chain's head again mid-sweep
            assert ix.lookup(chain).gpu_blocks == [0, 50]
            taken_back = True
    assert taken_back and ix.sizes()["gpu_nodes"] == 50 and 40 <= slices <= 45  # 2 x 2000 steps / 100
    assert ix.lookup(chain).gpu_blocks == [0, 50]
    ix.gpu_stored_hashes("a", chain)
    assert ix.lookup(chain).gpu_blocks == [2000, 50] and ix.sizes()["gpu_nodes"] == 2000


def test_gpu_cleared_clears_stale_entries_for_real():
    ix, clock = clocked()
    toks = list(range(32))
    ix.gpu_stored("i0", [1, 2], None, toks, 16)
    ix.mark_stale("i0")
    ix.gpu_cleared("i0")
    assert ix.lookup(fast_chain(toks, 16)).gpu_blocks == [0, 0]
    assert not ix.is_stale("i0") and ix.gpu_blocks_of("i0") == 0 and ix.sizes()["gpu_nodes"] == 0


def test_blocks_under_an_unknown_parent_are_kept_and_credited_once_it_reappears():
    ix, clock = clocked()
    toks = list(range(64))
    chain = fast_chain(toks, 16)
    # the events for blocks 0..1 were lost (a gap): 2..3 arrive under an unknown parent
    assert ix.gpu_stored("i0", [3, 4], 2, toks[32:], 16) == 0
    assert ix.stats["gpu_orphans"] == 2 and ix.stats["gpu_orphans_waiting"] == 2
    assert ix.lookup(chain).gpu_blocks == [0, 0]
    ix.gpu_stored("i0", [1, 2], None, toks[:32], 16)  # the parent chain reappears
    assert ix.lookup(chain).gpu_blocks == [4, 0]
    assert ix.stats["gpu_orphans_adopted"] == 2 and ix.stats["gpu_orphans_waiting"] == 0
    ix.gpu_removed("i0", [4])  # the adopted blocks resolve like any other
    assert ix.lookup(chain).gpu_blocks == [3, 0]


def test_orphans_of_a_removed_block_or_past_their_ttl_are_dropped():
    ix, clock = clocked(orphan_ttl_s=10)
    toks = list(range(64))
    ix.gpu_stored("i0", [3, 4], 2, toks[32:], 16)
    ix.gpu_removed("i0", [4])  # removed while waiting: only block 3 is left to adopt
    clock[0] = 11
    ix.gpu_stored("i0", [1, 2], None, toks[:32], 16)
    assert ix.lookup(fast_chain(toks, 16)).gpu_blocks == [2, 0]
    assert ix.stats["gpu_orphans_dropped"] == 2 and ix.stats["gpu_orphans_adopted"] == 0


def test_orphans_falling_due_together_expire_in_bounded_slices():
    # A full cap of orphan runs expiring in one call held the loop ~55 ms (bench/soak.py: 600 s
    # after its storm); each call now drops about EXPIRE_SLICE blocks and stays due for the rest.
    from smetric_lmc.index.side import EXPIRE_SLICE

    ix, clock = clocked(orphan_ttl_s=10)
    runs = 3 * EXPIRE_SLICE // 16
    for r in range(runs):
        ix.gpu_stored("i0", [10_000 + 16 * r + k for k in range(16)], 5_000 + r, list(range(256)), 16)
    assert ix.stats["gpu_orphans_waiting"] == 16 * runs
    clock[0] = 11
    slices = []
    while ix.needs_maintenance:
        before = ix.stats["gpu_orphans_waiting"]
        ix.maintain()
        slices.append(before - ix.stats["gpu_orphans_waiting"])
    assert slices == [EXPIRE_SLICE] * 3 and ix.stats["gpu_orphans_dropped"] == 16 * runs


# ---- issue: a fast follow-up can beat its own KV events ----------------------------------------
def test_pending_prompt_is_credited_until_confirmed_or_expired():
    ix, clock = clocked(pending_ttl_s=5)
    toks = list(range(64))
    chain = fast_chain(toks, 16)
    follow = fast_chain(toks + list(range(500, 532)), 16)
    assert ix.add_pending("i1", chain)
    assert ix.lookup(follow).local_hit_tokens() == [0, 64]
    assert ix.lookup(chain[:2]).local_hit_tokens() == [0, 0]  # a partial overlap waits for events
    ix.gpu_stored("i1", [1, 2, 3, 4], None, toks, 16)  # the engine confirms it
    assert ix.stats["pending_confirmed"] == 1 and ix.stats["pending_open"] == 0
    assert ix.lookup(follow).local_hit_tokens() == [0, 64]
    assert not ix.add_pending("i1", chain)  # already held: nothing pending
    ix.add_pending("i0", chain)
    clock[0] = 5
    assert ix.lookup(follow).local_hit_tokens() == [0, 64]
    assert ix.stats["pending_expired"] == 1 and ix.stats["pending_added"] == 2


def test_drop_instance_frees_its_slot_and_blocks():
    ix = make(2)
    toks = list(range(32))
    ix.gpu_stored("i0", [1, 2], None, toks, 16)
    ix.drop_instance("i0")
    assert ix.instances == ["i1"]
    assert ix.sizes()["gpu_nodes"] == 0
    assert ix.register_instance("i9") == 0  # slot reused
    assert ix.lookup(fast_chain(toks, 16)).gpu_blocks == [0, 0]


# ---- model-based: bisection over complete masks == walking a naive per-instance model -------


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32), st.integers(5, 60), st.integers(1, 5), st.integers(5, 80))
def test_lookup_matches_naive_model(seed, n_nodes, n_inst, n_ops):
    """Stores (orphans kept and adopted), removals, stale marks and their TTL, clears and pending
    prompts against a naive model; the tree stays complete and linked throughout."""
    rng = random.Random(seed)
    parent = random_tree(rng, n_nodes)
    clock = [0.0]
    ix = TierIndex(16, 16, clock=lambda: clock[0], stale_ttl_s=10, pending_ttl_s=5, orphan_ttl_s=1e9,
                   sweep_rows=rng.choice([1, 4, 1 << 16]), sweep_work=rng.choice([1, 3, 2048]))
    naive = Naive(parent)
    insts = [f"i{k}" for k in range(n_inst)]
    for i in insts:
        ix.register_instance(i)
    nodes = list(parent)
    for _ in range(n_ops):
        inst = rng.choice(insts)
        node = rng.choice(nodes)
        op = rng.random()
        if op < 0.5:
            p = path_to(parent, node)
            cut = rng.randrange(len(p))  # store a suffix of the path under its parent
            seg = p[cut:]
            ix.gpu_stored_hashes(inst, seg, p[cut - 1] if cut else None)
            naive.store(inst, seg, clock[0])
        elif op < 0.7:
            ix.gpu_removed_hashes(inst, [node])
            naive.remove(inst, node)
        elif op < 0.78:
            ix.mark_stale(inst)
            naive.mark_stale(inst, clock[0], 10)
        elif op < 0.85:
            clock[0] += rng.choice([1, 4, 6, 11])
            naive.tick(clock[0])
        elif op < 0.88:
            ix.gpu_cleared(inst)
            naive.clear(inst)
        else:
            p = path_to(parent, node)
            if ix.add_pending(inst, p):
                naive.pending.setdefault(inst, {})[p[-1]] = clock[0] + 5
            else:
                assert p[-1] in naive.held.get(inst, set())
        for _ in range(3 if rng.random() < 0.3 else 0):
            ix.maintain()
        q = path_to(parent, rng.choice(nodes))
        found = ix.lookup(q)
        want = [16 * naive.local(i, q, clock[0]) for i in insts]
        # the route's sparse queries, asked before anything dense is built
        assert [found.at(k) for k in range(len(insts))] == want
        top = max(want)
        holders = [k for k, v in enumerate(want) if v == top]
        assert found.best() == (top, None if top == 0 or len(holders) == len(insts) else holders)
        assert found.gpu_blocks == [naive.hit(i, q) for i in insts]
        assert found.stale_hit_tokens() == [16 * (naive.hit(i, q) - naive.hit(i, q, "fresh")) for i in insts]
        assert found.local_hit_tokens() == [16 * naive.local(i, q, clock[0]) for i in insts]
    assert [ix.gpu_blocks_of(i) for i in insts] == [len(naive.held.get(i, ())) for i in insts]
    assert [ix.is_stale(i) for i in insts] == [bool(naive.held.get(i, set()) - naive.fresh.get(i, set()))
                                                 for i in insts]
    # Completeness: a slot holding a block holds its parent; the child lists match the parents.
    t = ix._tree
    for r in range(1, len(t.key)):
        if not t.key[r] or not t.mask(r):
            continue
        m, p = t.view[t.mid[r]], t.par[r]
        assert p == 0 or t.view[t.mid[p]] & m == m
        assert (p == 0) == (parent[t.key[r]] is None)
        assert p == 0 or t.key[p] == parent[t.key[r]]
        if p:
            c, kids = t.kid[p], []
            while c:
                kids.append(c)
                c = t.nxt[c]
            assert r in kids
    for _ in range(1000):  # bounded slices free every row emptied by bulk clears
        if not t.garbage:
            break
        ix.maintain()
    assert ix.sizes()["gpu_nodes"] == len(set().union(*naive.held.values()) if naive.held else set())


def test_fixture_frames_predict_the_engines_cached_tokens(vllm_fixture):
    """Apply the real vLLM events in order; before each request, the index's hit for its prompt
    equals what the engine then reported as cached (vLLM always recomputes a prompt's last token,
    so a fully cached prompt reports one block less)."""
    bs = vllm_fixture["server"]["block_size"]
    ix = TierIndex(bs, 256)
    ix.register_instance("e0")
    frames = {f["seq"]: f for f in vllm_fixture["frames_decoded"]}
    applied = -1
    checked = 0
    for req in vllm_fixture["requests"]:
        usage = req.get("usage")
        toks = req.get("prompt_token_ids")
        if usage and toks:
            hit = ix.lookup(fast_chain(toks, bs)).gpu_blocks[0] * bs
            if hit >= len(toks):
                hit = (len(toks) - 1) // bs * bs
            assert hit == usage["prompt_tokens_details"]["cached_tokens"], req.get("note")
            checked += 1
        for seq in req.get("kv_event_seqs_after_request", []):
            assert seq == applied + 1
            for ev in frames[seq]["events"]:
                t = ev["type"]
                if t == "BlockStored":
                    ix.gpu_stored("e0", ev["block_hashes"], ev.get("parent_block_hash"), ev["token_ids"], ev["block_size"])
                elif t == "BlockRemoved":
                    ix.gpu_removed("e0", ev["block_hashes"])
                elif t == "AllBlocksCleared":
                    ix.gpu_cleared("e0")
            applied = seq
    assert checked >= 10
    assert ix.stats["gpu_orphans"] == 0 and ix.stats["gpu_unknown_removed"] == 0


def test_pending_prompts_of_many_lengths_are_found_by_their_anchor():
    ix, clock = clocked(3)
    base = list(range(16 * 300))
    chains = {n: fast_chain(base[: 16 * n], 16) for n in (1, 3, 63, 64, 100, 200)}
    for k, n in enumerate(chains):
        ix.add_pending(f"i{k % 3}", chains[n])
    # i0 holds 1 and 64 blocks pending, i1 3 and 100, i2 63 and 200
    want = {150: [16 * 64, 16 * 100, 16 * 63], 64: [16 * 64, 16 * 3, 16 * 63], 2: [16, 0, 0]}
    for n, hits in want.items():
        assert ix.lookup(fast_chain(base[: 16 * n], 16)).local_hit_tokens() == hits
    other = fast_chain([7] * 16 + base[16:16 * 150], 16)  # diverges at block 0: nothing pending
    assert ix.lookup(other).local_hit_tokens() == [0, 0, 0]


def test_a_long_chain_of_orphan_runs_is_adopted_without_recursion():
    """After a gap, every later event of the sequence is an orphan (one run per decode step)."""
    ix, clock = clocked(orphan_cap_blocks=10_000)
    toks = list(range(16 * 3000))
    for j in range(1, 3000):  # blocks 1.. arrive one event each; block 0's event was lost
        ix.gpu_stored("i0", [j + 1], j, toks[16 * j:16 * (j + 1)], 16)
    assert ix.stats["gpu_orphans_waiting"] == 2999
    ix.gpu_stored("i0", [1], None, toks[:16], 16)
    assert ix.lookup(fast_chain(toks, 16)).gpu_blocks == [3000, 0]
    assert ix.stats["gpu_orphans_adopted"] == 2999


def test_the_orphan_cap_drops_only_that_instances_oldest_runs():
    ix, clock = clocked(orphan_cap_blocks=4)
    toks = list(range(16 * 8))
    ix.gpu_stored("i1", [50, 51], 40, toks[:32], 16)  # i1 waits for its parent too
    for j in range(6):  # i0: six one-block runs, each under an unknown parent
        ix.gpu_stored("i0", [100 + j], 90 + j, toks[16 * j:16 * (j + 1)], 16)
    assert ix.stats["gpu_orphans_dropped"] == 2 and ix.stats["gpu_orphans_waiting"] == 6
    ix.gpu_stored("i1", [40], None, list(range(500, 516)), 16)  # i1's parent arrives: its run is intact
    assert ix.stats["gpu_orphans_adopted"] == 2


# ---- ids that are not chain hashes (a trace's, the simulator's): the tree must stay linked -----
def assert_linked(ix):
    """No row freed twice, no cycle, child lists match parents, per-slot counts match the rows."""
    t = ix._tree
    free = list(t.free)
    assert len(set(free)) == len(free), "a row was freed twice"
    gone = set(free)
    live = [r for r in range(1, len(t.key)) if r not in gone]
    for r in live:
        assert t.key[r] and t.rows.find(t.key[r]) == r
        seen, x = set(), r
        while x:  # walking parents terminates, through live rows only
            assert x not in seen and x not in gone
            seen.add(x)
            x = t.par[x]
        c, before, n = t.kid[r], 0, 0
        while c:  # a child list ends, and links back only to its own rows
            assert t.par[c] == r and t.prv[c] == before and c not in gone and n < len(t.key)
            before, c, n = c, t.nxt[c], n + 1
        p = t.par[r]
        if p and t.mask(r):
            assert t.view[t.mid[p]] & t.view[t.mid[r]] == t.view[t.mid[r]]  # masks stay complete
    assert t.nodes == len(live)
    for iid in ix.instances:
        bit, sbit = ix._bits(ix._slots[iid])
        assert ix.gpu_blocks_of(iid) == sum(1 for r in live if t.mask(r) & (bit | sbit))


def test_a_block_stored_under_another_parent_never_frees_a_row_twice():
    """Block 2 hangs under 1 (instance a); b stores 2 at the root. b's bit used to sit on row 2
    alone, so a's removal of 1 emptied rows 1 and 3 around a surviving row 2 and freed row 3 twice:
    two later blocks shared one row, their links formed a cycle and a subtree walk grew without
    bound. The key names row 2's prefix, so b is taken to hold 1 as well."""
    ix = make(2)
    ix.gpu_stored_hashes("i0", [1, 2, 3])
    ix.gpu_stored_hashes("i1", [2])
    assert_linked(ix)
    ix.gpu_removed_hashes("i0", [1])
    assert_linked(ix)
    assert ix.gpu_block_counts() == {"i0": 0, "i1": 2}
    ix.gpu_stored_hashes("i0", [4, 5])
    ix.gpu_stored_hashes("i0", [6], 5)
    ix.gpu_removed_hashes("i1", [1])
    assert_linked(ix)
    assert ix.sizes()["gpu_nodes"] == 3


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32))
def test_made_up_ids_keep_the_tree_linked(seed):
    """Stores of ids from a small pool (the same id under several parents, on many instances),
    removals, stale marks, clears and sweeps, rows reused throughout: links checked after each."""
    rng = random.Random(seed)
    clock = [0.0]
    ix = TierIndex(16, 16, clock=lambda: clock[0], stale_ttl_s=10, sweep_rows=rng.choice([1, 4, 1 << 16]), sweep_work=rng.choice([1, 3, 2048]))
    insts = [f"i{k}" for k in range(8)]
    for i in insts:
        ix.register_instance(i)
    held: dict[str, list[int]] = {i: [] for i in insts}
    for _ in range(60):
        inst = rng.choice(insts)
        op = rng.random()
        if op < 0.55:
            hs = rng.sample(range(1, 31), rng.randint(1, 5))
            parent = rng.choice(held[inst]) if held[inst] and rng.random() < 0.5 else None
            ix.gpu_stored_hashes(inst, hs, parent)
            held[inst] += hs
        elif op < 0.85:
            ix.gpu_removed_hashes(inst, [rng.randint(1, 30)])
        elif op < 0.9:
            ix.mark_stale(inst)
        elif op < 0.94:
            clock[0] += 11
            ix.maintain()
        else:
            ix.gpu_cleared(inst)
            held[inst] = []
        assert_linked(ix)


def test_pending_expiry_churn_does_not_pile_up_young_gc_objects():
    # The pending queue's per-route record, freed at its deadline as new routes come, must not be
    # GC-tracked (see tests/test_load.py::test_expiry_churn_does_not_pile_up_young_gc_objects).
    from load_helpers import young_after_churn

    from smetric_lmc.index.side import Pending

    p = Pending(ttl_s=5.0)
    # 8,000 distinct prompts, each back after 8 s: most expire first (distinct prompts are the norm).
    chains = [[k * 7 + 1, k * 7 + 2, k * 7 + 3] for k in range(8_000)]

    def step(k):
        now = k / 1000
        p.expire(now)
        p.add(0, chains[k % 8_000], now)

    young = young_after_churn(step)
    assert p.added == 20_000 and p.expired > 0
    assert young < 2_000, f"{young} young GC objects: pending queue records are GC-tracked"


def test_pending_expires_at_its_deadline_unless_refreshed():
    from smetric_lmc.index.side import Pending

    p = Pending(ttl_s=10.0)
    p.add(0, [1, 2, 3], 0.0)
    p.add(1, [1, 2, 3], 4.0)
    assert p.next_deadline() == 10.0
    p.expire(10.0)
    assert p.credits([1, 2, 3, 4]) == [(1, 3)] and p.expired == 1
    p.add(1, [1, 2, 3], 8.0)  # refreshed: its old record no longer expires it
    p.expire(14.0)
    assert p.credits([1, 2, 3]) == [(1, 3)] and p.expired == 1
    p.expire(18.0)
    assert not p and p.expired == 2 and p.next_deadline() == float("inf")
