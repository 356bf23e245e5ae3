"""The index's ingest paths (bulk chain stores, inline leaf removals, subtree frees) against a naive
model, with the tree's own bookkeeping (maps, links, mask refcounts, per-slot counts) checked after
every step."""

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from index_helpers import Naive, path_to, random_tree

from smetric_lmc.hashing import fast_chain
from smetric_lmc.index import TierIndex

BS = 4


def check_tree(ix: TierIndex) -> None:
    """Every invariant the inlined hot loops must keep."""
    t = ix._tree
    n_rows = len(t.key)
    for col in (t.eng, t.mid, t.par, t.kid, t.nxt, t.prv, t.run):
        assert len(col) == n_rows
    live = [r for r in range(1, n_rows) if t.key[r]]
    assert sorted(t.free) == [r for r in range(1, n_rows) if not t.key[r]]
    assert not any(t.mid[r] for r in t.free)  # a free row holds nothing (exports select rows by mask)
    assert t.nodes == len(live) == t.rows.n
    # Maps: each live row once, under its key; each engine hash once, under its row.
    assert sorted(x for x in t.rows.slots if x) == live
    assert all(t.rows.find(t.key[r]) == r for r in live)
    with_eng = [r for r in live if t.eng[r]]
    assert sorted(x for x in t.alias.slots if x) == with_eng
    assert t.alias.n == len(with_eng)
    assert all(t.alias.find(t.eng[r]) == r for r in with_eng)
    for table in (t.rows, t.alias):
        assert not table.slots[-1]  # the tail's last slot stays empty: probes end
    # Links: child lists are the inverse of parent links.
    kids: dict[int, list[int]] = {r: [] for r in live}
    for r in live:
        p = t.par[r]
        if p:
            assert t.key[p], f"row {r}'s parent {p} is free"
            kids[p].append(r)
    for r in live:
        seen, c, before = [], t.kid[r], 0
        while c:
            assert t.prv[c] == before
            seen.append(c)
            before, c = c, t.nxt[c]
        assert sorted(seen) == sorted(kids[r])
    # Masks: refcounts match the rows using each id; per-slot counts match the rows' bits.
    refs = Counter(t.mid[r] for r in live)
    assert all(t.mref[i] == refs.get(i, 0) for i in range(1, len(t.mref)))
    for b, n in t.count.items():
        assert n == sum(1 for r in live if t.mval[t.mid[r]] & b), b


def tokens_of(parent: dict, node: int) -> list[int]:
    return [tok for x in path_to(parent, node) for tok in [x] * BS]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.integers(5, 50), st.integers(1, 4), st.integers(5, 60))
def test_vllm_ingest_matches_naive_model(seed, n_nodes, n_inst, n_ops):
    """``gpu_stored``/``gpu_removed`` as vLLM sends them: engine hashes (one engine with a hash
    scheme of its own, whose aliases are kept per instance), tail-first removal batches, unknown
    removals, stale marks and clears."""
    rng = random.Random(seed)
    parent = random_tree(rng, n_nodes)
    clock = [0.0]
    ix = TierIndex(BS, BS, clock=lambda: clock[0], stale_ttl_s=10, orphan_ttl_s=1e9, sweep_rows=rng.choice([1, 1 << 16]), sweep_work=rng.choice([1, 3, 2048]))
    naive = Naive(parent)
    insts = [f"i{k}" for k in range(n_inst)]
    for i in insts:
        ix.register_instance(i)
    own = {i: (k == 1) for k, i in enumerate(insts)}  # i1 hashes blocks its own way

    def eng(inst: str, node: int) -> int:
        return (node * 0x9E3779B97F4A7C15 + (0xABCDEF if own[inst] else 0)) & ((1 << 64) - 1) or 1

    ours = {n: fast_chain(tokens_of(parent, n), BS)[-1] for n in parent}
    nodes = list(parent)
    for _ in range(n_ops):
        inst = rng.choice(insts)
        op = rng.random()
        if op < 0.45:
            p = path_to(parent, rng.choice(nodes))
            cut = rng.randrange(len(p))
            seg = p[cut:]
            toks = [tok for x in seg for tok in [x] * BS]
            ix.gpu_stored(inst, [eng(inst, x) for x in seg], eng(inst, p[cut - 1]) if cut else None, toks, BS)
            naive.store(inst, seg, clock[0])
        elif op < 0.7:  # evict a held chain's tail, tail first, in one batch (as apply_batch merges them)
            held = naive.held.get(inst, set())
            leaves = [x for x in held if not any(parent[y] == x for y in held)]
            if not leaves:
                continue
            tail = path_to(parent, rng.choice(leaves))[::-1][: rng.randint(1, 6)]
            ix.gpu_removed(inst, [eng(inst, x) for x in tail] + [rng.getrandbits(64) | 1])
            for x in tail:
                naive.remove(inst, x)
        elif op < 0.8:  # a block in the middle: its descendants go too
            x = rng.choice(sorted(naive.held.get(inst, set())) or nodes)
            if x in naive.held.get(inst, set()):
                ix.gpu_removed(inst, [eng(inst, x)])
                naive.remove(inst, x)
        elif op < 0.87:
            ix.mark_stale(inst)
            naive.mark_stale(inst, clock[0], 10)
        elif op < 0.94:
            clock[0] += rng.choice([1, 6, 11])
            naive.tick(clock[0])
            ix.expire()
        else:
            ix.gpu_cleared(inst)
            naive.clear(inst)
        check_tree(ix)
        q = path_to(parent, rng.choice(nodes))
        found = ix.lookup([ours[x] for x in q])
        assert found.gpu_blocks == [naive.hit(i, q) for i in insts]
        assert found.stale_hit_tokens() == [BS * (naive.hit(i, q) - naive.hit(i, q, "fresh")) for i in insts]
    assert [ix.gpu_blocks_of(i) for i in insts] == [len(naive.held.get(i, ())) for i in insts]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.integers(5, 60), st.integers(1, 4), st.integers(5, 60))
def test_simulator_ingest_keeps_the_tree_consistent(seed, n_nodes, n_inst, n_ops):
    """``gpu_stored_hashes``/``gpu_removed_hashes`` (the simulator's long chains and subtree
    frees) keep every map, link and count consistent; rows freed are reused."""
    rng = random.Random(seed)
    parent = random_tree(rng, n_nodes)
    ix = TierIndex(16, 16, sweep_rows=rng.choice([1, 1 << 16]), sweep_work=rng.choice([1, 3, 2048]))
    naive = Naive(parent)
    insts = [f"i{k}" for k in range(n_inst)]
    for i in insts:
        ix.register_instance(i)
    nodes = list(parent)
    for _ in range(n_ops):
        inst = rng.choice(insts)
        node = rng.choice(nodes)
        if rng.random() < 0.55:
            p = path_to(parent, node)
            cut = rng.randrange(len(p))
            ix.gpu_stored_hashes(inst, p[cut:], p[cut - 1] if cut else None)
            naive.store(inst, p[cut:], 0.0)
        else:
            ix.gpu_removed_hashes(inst, [node])
            naive.remove(inst, node)
        if rng.random() < 0.1:
            ix.gpu_cleared(inst)
            naive.held[inst], naive.fresh[inst], naive.waiting[inst] = set(), set(), []
        check_tree(ix)
        q = path_to(parent, rng.choice(nodes))
        assert ix.lookup(q).gpu_blocks == [naive.hit(i, q) for i in insts]


def test_made_up_hashes_that_break_the_chain_rule_are_stored_like_before():
    """A store whose later block exists already (only made-up hashes do that) falls back from
    the bulk path: the existing row is reused, as the per-block path always did."""
    ix = TierIndex(16)
    ix.register_instance("a")
    ix.register_instance("b")
    ix.gpu_stored_hashes("a", [10, 11, 12])
    ix.gpu_stored_hashes("b", [20, 21, 11, 22])  # 11 exists (under 10): reused, not duplicated
    check_tree(ix)
    assert ix.sizes()["gpu_nodes"] == 6
    assert ix.lookup([20, 21]).gpu_blocks == [0, 2]
    assert ix.gpu_removed_hashes("b", [21]) == 1
    check_tree(ix)
    assert ix.lookup([20, 21]).gpu_blocks == [0, 1]


def test_rows_freed_tail_first_are_reused_in_place_and_maps_grow_mid_store():
    ix = TierIndex(16)
    ix.register_instance("a")
    t = ix._tree
    chain = list(range(1, 3001))  # grows both maps past their first size inside one store
    engine = [x + (1 << 40) for x in chain]
    toks = [tok for x in chain for tok in [x % 1000] * 16]
    ix.gpu_stored("a", engine, None, toks, 16)
    check_tree(ix)
    rows_before = len(t.key)
    ix.gpu_removed("a", engine[::-1][:1000])  # vLLM's eviction order: tail first
    check_tree(ix)
    assert ix.gpu_blocks_of("a") == 2000
    ours = fast_chain(toks, 16)
    ix.gpu_stored("a", [x + (2 << 40) for x in chain[2000:]], engine[1999], toks[2000 * 16:], 16)
    check_tree(ix)
    assert len(t.key) == rows_before  # the freed rows were taken again
    assert ix.lookup(ours).gpu_blocks == [3000]
    assert ix.stats["gpu_unknown_removed"] == 0
    # Rows that had engine hashes, freed by a subtree removal, reused by a store without any.
    ix.gpu_removed("a", [x + (2 << 40) for x in chain[2500:2501]])
    check_tree(ix)
    ix.gpu_stored_hashes("a", ours[2500:], ours[2499])
    check_tree(ix)
    assert len(t.key) == rows_before
    assert ix.lookup(ours).gpu_blocks == [3000]


def test_a_block_removed_twice_in_one_batch_is_freed_once():
    """Removals free their key-map entries at the end of a batch: a hash repeated within it must
    count as unknown, not free its row again."""
    ix = TierIndex(16)
    for iid in ("a", "b"):
        ix.register_instance(iid)
    chain = list(range(1, 401))
    engine = [x + (1 << 40) for x in chain]
    toks = [tok for x in chain for tok in [x % 1000] * 16]
    ix.gpu_stored("a", engine, None, toks, 16)
    ix.gpu_stored("b", engine[:100], None, toks[: 100 * 16], 16)
    tail = engine[::-1][:150]  # tail first, as vLLM evicts
    assert ix.gpu_removed("a", tail + tail[:10] + [engine[399]]) == 150
    check_tree(ix)
    assert ix.stats["gpu_unknown_removed"] == 11
    assert ix.lookup(fast_chain(toks, 16)).gpu_blocks == [250, 100]
    ix.gpu_stored("a", engine[250:], engine[249], toks[250 * 16:], 16)  # the freed rows come back
    check_tree(ix)
    assert ix.lookup(fast_chain(toks, 16)).gpu_blocks == [400, 100]


def test_a_probe_run_into_the_maps_tail_grows_them_mid_store():
    """Made-up keys and engine hashes sharing their low 20 bits pile into one cluster that runs
    past the maps' tail within a single store."""
    ix = TierIndex(16)
    ix.register_instance("a")
    keys = [(j << 20) | 0xFFFFF for j in range(1, 1101)]
    ix.gpu_stored_hashes("a", keys, engine_hashes=[k ^ (1 << 63) for k in keys])
    check_tree(ix)
    assert ix.lookup(keys).gpu_blocks == [1100]
    ix.gpu_removed("a", [k ^ (1 << 63) for k in keys[::-1][:600]])
    check_tree(ix)
    assert ix.lookup(keys).gpu_blocks == [500]


def test_an_engine_hash_another_block_has_is_kept_as_that_instances_own():
    ix = TierIndex(16)
    ix.register_instance("a")
    ix.register_instance("b")
    ta, tb = [1] * 16, [2] * 16
    ix.gpu_stored("a", [77], None, ta, 16)
    ix.gpu_stored("b", [77], None, tb, 16)  # same engine hash, other tokens: b's own alias
    check_tree(ix)
    assert ix.gpu_removed("b", [77]) == 1
    check_tree(ix)
    assert ix.lookup(fast_chain(ta, 16)).gpu_blocks == [1, 0]
    assert ix.lookup(fast_chain(tb, 16)).gpu_blocks == [0, 0]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([0, 0xFFFFF, (1 << 64) - 1024]))
def test_key_index_matches_a_dict(seed, low_bits):
    """The map the hot loops inline: inserts, finds, deletes (by key and by row) and growth agree
    with a dict, clustered keys included."""
    from array import array

    from smetric_lmc.index.table import KeyIndex

    rng = random.Random(seed)
    keys = array("Q", [0])
    m = KeyIndex(keys)
    model: dict[int, int] = {}
    for _ in range(rng.randint(100, 3000)):
        if model and rng.random() < 0.4:
            h = rng.choice(list(model))
            r = model.pop(h)
            if rng.random() < 0.5:
                assert m.delete(h)
            else:
                m.drop_rows((r,))
            keys[r] = 0
        else:
            h = (rng.getrandbits(44) << 20 | low_bits) & ((1 << 64) - 1) or 1
            keys.append(h)
            assert m.add(h, len(keys) - 1) == (h not in model)
            if h not in model:
                model[h] = len(keys) - 1
        assert m.n == len(model)
    assert all(m.find(h) == r for h, r in model.items())
    assert sorted(x for x in m.slots if x) == sorted(model.values())
    assert not m.delete(0)
