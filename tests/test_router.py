"""The routing step shared by controller and simulator: index -> view -> policy -> load."""

from smetric_lmc.config import PolicyConfig
from smetric_lmc.hashing import fast_chain
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router
from smetric_lmc.wire import Reason, TurnSource


def cluster(n=3, policy="smetric", **kw):
    ix = TierIndex(16, 64)
    for k in range(n):
        ix.register_instance(f"i{k}")
    return Router(ix, LoadTracker(), PolicyConfig(name=policy, **kw))


def test_session_follows_its_kv_and_load_is_counted_at_route_time():
    r = cluster()
    first = list(range(100))
    a = r.route("s1-t0", fast_chain(first, 16), None, len(first), turn=0)
    assert a.reason == Reason.FIRST_TURN
    # The engine reports what it cached for the first turn.
    r.index.gpu_stored_hashes(a.instance_id, fast_chain(first, 16))
    # A burst of first turns spreads: the in-flight count of s1 makes its instance busier.
    others = {r.route(f"s{k}-t0", [], None, 10, turn=0).instance_id for k in range(2, 4)}
    assert a.instance_id not in others and len(others) == 2
    r.load.on_done("s1-t0")
    follow = list(range(150))
    b = r.route("s1-t1", fast_chain(follow, 16), None, len(follow), turn=1, est_hit=100)
    assert (b.instance_id, b.reason) == (a.instance_id, Reason.STICKY)
    assert b.local_hit_tokens == 96 and b.est_hit_tokens == 96  # both at block granularity


def test_unknown_turn_is_inferred_from_est_hit():
    r = cluster()
    assert r.route("x", [], None, 10).turn == 0
    assert r.route("y", [], None, 10, est_hit=64).turn == 1
    assert r.route("z", [], None, 10, est_hit=64).turn_source == TurnSource.EST_HIT


def test_disaggregated_load_is_unprefilled_tokens_and_candidates_filter():
    r = cluster()
    r.disaggregated = True
    r.route("big", [], None, 5000, turn=0, candidates=["i0", "i1"])
    picks = [r.route(f"q{k}", [], None, 100, turn=0, candidates=["i0", "i1"]).instance_id for k in range(3)]
    assert "i2" not in picks
    assert picks.count(r.load.instance_of("big")) == 0  # 5000 queued tokens outweigh three small ones


def test_no_candidates_means_no_instances():
    r = cluster()
    d = r.route("z", [], None, 10, candidates=["gone"])
    assert d.instance_id is None and d.reason == Reason.NO_INSTANCES


def test_hot_policy_swap():
    r = cluster()
    r.route("warm", [], None, 1)  # the round-robin cursor is shared across policies
    r.set_policy(PolicyConfig(name="round_robin"))
    picks = [r.route(f"r{k}", [], None, 1) for k in range(3)]
    assert [p.instance_id for p in picks] == ["i1", "i2", "i0"]
    assert {p.policy for p in picks} == {"round_robin"} and picks[0].reason == Reason.ROUND_ROBIN


def test_a_follow_up_routed_before_its_kv_events_stays_with_its_session():
    """The first turn's blocks are pending on its instance until the engine reports them."""
    r = cluster()
    first = list(range(100))
    a = r.route("s1-t0", fast_chain(first, 16), None, len(first), turn=0)
    r.route("s2-t0", [], None, 10, turn=0)
    r.load.on_done("s1-t0")
    follow = first + list(range(1000, 1050))
    b = r.route("s1-t1", fast_chain(follow, 16), None, len(follow), turn=1, est_hit=100)
    assert (b.instance_id, b.reason) == (a.instance_id, Reason.STICKY)
    assert b.local_hit_tokens == 96
    assert r.index.stats["pending_added"] == 2  # s2 had no full block


def test_a_growing_prompt_without_turn_stays_with_its_cache():
    # /v1/completions clients send no turn: each request is the previous prompt plus more text.
    r = cluster(n=2)
    system = list(range(5000, 5064))  # a system prompt every instance holds
    for iid in r.index.instances:
        r.index.gpu_stored_hashes(iid, fast_chain(system, 16))
    prompt = system + list(range(40))
    homes = []
    for t in range(6):
        d = r.route(f"c{t}", fast_chain(prompt, 16), None, len(prompt))
        homes.append(d.instance_id)
        if t == 0:  # only the shared prefix is cached anywhere: a first turn, balanced
            assert (d.turn, d.turn_source, d.reason) == (0, TurnSource.INDEX_FIRST_TURN, Reason.FIRST_TURN)
        else:  # its own history runs past the shared prefix on one instance: a follow-up there
            assert (d.turn, d.turn_source, d.reason) == (1, TurnSource.INDEX_FOLLOW_UP, Reason.STICKY)
            assert d.est_hit_tokens == d.local_hit_tokens == d.best_local_hit_tokens > len(system)
        r.index.gpu_stored_hashes(d.instance_id, fast_chain(prompt, 16))
        r.load.on_done(f"c{t}")
        prompt = prompt + list(range(100 + 40 * t, 140 + 40 * t))
    assert len(set(homes)) == 1, homes


def test_inferred_follow_up_still_sheds_an_overloaded_instance():
    r = cluster(n=3)
    mine = list(range(200))
    r.index.gpu_stored_hashes("i0", fast_chain(mine, 16))
    for k in range(6):
        r.load.on_route(f"busy{k}", "i0", 10)
    d = r.route("q", fast_chain(mine + [1] * 32, 16), None, 232)
    assert (d.turn_source, d.reason, d.instance_id) == (TurnSource.INDEX_FOLLOW_UP, Reason.OVERLOADED, "i1")
    assert r.load.in_flight("i1") == 1


def test_every_policy_decides_as_on_the_dense_view():
    """The router answers policies from the lookup's hit groups and the tracker's load buckets;
    each decision must equal the policy's choice on plain per-instance lists of the same state
    (ties, shared prefixes, LMCache-only holders, pending prompts and missing turns included)."""
    import random

    from smetric_lmc.policy import POLICY_NAMES, ClusterView, make_policy

    rng = random.Random(11)
    for name in POLICY_NAMES:
        r = cluster(5, name)
        ix, ids = r.index, r.index.instances
        shared = list(range(10_000, 10_064))
        prompts = [shared + [rng.randrange(1000) for _ in range(rng.choice((16, 64, 128)))] for _ in range(12)]
        for step in range(150):
            p = rng.choice(prompts)
            inst = rng.choice(ids)
            op = rng.random()
            if op < 0.3:
                ix.gpu_stored_hashes(inst, fast_chain(p[: rng.randrange(16, len(p) + 1)], 16))
            elif op < 0.4:
                ix.lmcache_admit(inst, fast_chain(p, 64))
            elif op < 0.5:
                live = [f"q{k}" for k in range(step) if r.load.instance_of(f"q{k}") is not None]  # in flight
                r.load.on_done(rng.choice(live or ["none"]))
            blocks, chunks = fast_chain(p, 16), fast_chain(p, 64)
            turn = rng.choice((None, 0, 1))
            found = ix.lookup(blocks, chunks)
            c, loads = found.local_hit_tokens(), r.load.loads(ids)
            unpre = [float(r.load.unprefilled(i)) for i in ids]
            before = list(r.rotation)  # the pointers the decision read (one per request kind)
            got = r.decide(f"q{step}", ix.lookup(blocks, chunks), len(p), turn=turn, est_hit=64 * rng.randrange(2))
            dense = ClusterView(ids, c, loads, len(p), got.turn, got.est_hit_tokens, found.global_hit_tokens,
                                unpre, [float(x) for x in loads], before[got.turn != 0])
            want = make_policy(PolicyConfig(name=name))(dense)
            assert (got.instance_id, got.reason) == (ids[want.index], want.reason), (name, step)
            assert got.local_hit_tokens == c[want.index] and got.best_local_hit_tokens == max(c), (name, step)
            assert got.load == loads[want.index], (name, step)
