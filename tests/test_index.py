"""TierIndex: per-instance contiguous hits per tier, checked against a naive model and real frames."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from smetric_lmc.hashing import fast_chain
from smetric_lmc.index import TierIndex


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
    assert found.gpu_blocks[0] == 2 and found.lmcache_chunks[0] == 1
    assert found.local_hit_tokens()[0] == 64


def test_global_tier_contiguous():
    ix = make()
    ix.global_stored([1, 2, 4])
    assert ix.lookup([], [1, 2, 3, 4]).global_hit_tokens == 128
    ix.global_removed([1])
    assert ix.lookup([], [1, 2]).global_chunks == 0
    ix.global_reset([1, 2, 3])
    assert ix.lookup([], [1, 2, 3, 4]).global_chunks == 3


def test_orphans_and_unknown_instances_are_counted_not_applied():
    ix = make()
    assert ix.gpu_stored("i0", [5], 999, list(range(16)), 16) == 0
    assert ix.stats["gpu_orphans"] == 1
    assert ix.gpu_stored("nope", [5], None, list(range(16)), 16) == 0
    assert ix.stats["unknown_instance"] == 1
    assert ix.gpu_stored("i0", [5], None, list(range(15)), 16) == 0  # tokens do not fill the block
    assert ix.stats["bad_block_size"] == 1


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
class Naive:
    """Per instance: the set of held blocks, contiguous from the root (a child needs its parent)."""

    def __init__(self, parent):
        self.parent = parent
        self.held: dict[str, set[int]] = {}

    def store(self, inst, chain):
        s = self.held.setdefault(inst, set())
        first_parent = self.parent[chain[0]]
        if first_parent is not None and first_parent not in s:
            return
        s.update(chain)

    def remove(self, inst, b):
        s = self.held.setdefault(inst, set())
        if b not in s:
            return
        todo = [b]
        while todo:  # descendants lose contiguity with the root
            x = todo.pop()
            if x in s:
                s.discard(x)
                todo.extend(k for k, p in self.parent.items() if p == x)

    def hit(self, inst, chain):
        s = self.held.get(inst, set())
        n = 0
        for h in chain:
            if h not in s:
                break
            n += 1
        return n


def random_tree(rng, n_nodes):
    parent = {1: None}
    for k in range(2, n_nodes + 1):
        parent[k] = rng.choice([None] + list(parent)) if rng.random() < 0.9 else None
    return parent


def path_to(parent, node):
    out = []
    while node is not None:
        out.append(node)
        node = parent[node]
    return out[::-1]


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32), st.integers(5, 60), st.integers(1, 5), st.integers(5, 80))
def test_lookup_matches_naive_model(seed, n_nodes, n_inst, n_ops):
    rng = random.Random(seed)
    parent = random_tree(rng, n_nodes)
    ix = TierIndex(16, 16)
    naive = Naive(parent)
    insts = [f"i{k}" for k in range(n_inst)]
    for i in insts:
        ix.register_instance(i)
    nodes = list(parent)
    for _ in range(n_ops):
        inst = rng.choice(insts)
        node = rng.choice(nodes)
        if rng.random() < 0.65:
            p = path_to(parent, node)
            cut = rng.randrange(len(p))  # store a suffix of the path under its parent
            seg = p[cut:]
            ix.gpu_stored_hashes(inst, seg, p[cut - 1] if cut else None)
            naive.store(inst, seg)
        else:
            ix.gpu_removed_hashes(inst, [node])
            naive.remove(inst, node)
        q = path_to(parent, rng.choice(nodes))
        got = ix.lookup(q).gpu_blocks
        assert got == [naive.hit(i, q) for i in insts]
    assert [ix.gpu_blocks_of(i) for i in insts] == [len(naive.held.get(i, ())) for i in insts]
    # Completeness: a slot holding a block holds its parent; the tree links match the masks.
    for h, m in ix._mask.items():
        p = ix._parent.get(h)
        assert m and (p is None or ix._mask[p] & m == m)
        assert (p is None) == (parent[h] is None)
    for p, k in ix._kid.items():
        assert ix._parent[k] == p
        assert all(ix._parent[x] == p for x in ix._more_kids.get(p, []))


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
