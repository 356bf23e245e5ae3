from load_helpers import young_after_churn

from smetric_lmc.load import LoadTracker
from smetric_lmc.policy import rr_argmin


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_counts_from_route_until_done():
    lt = LoadTracker()
    lt.on_route("r1", "a", 1000, 600)
    lt.on_route("r2", "a", 500)
    assert lt.loads(["a", "b"]) == [2.0, 0.0]
    assert lt.loads(["a"], disaggregated=True) == [900.0]
    lt.on_prefilled("r1")
    assert lt.unprefilled("a") == 500
    assert lt.on_done("r1") and not lt.on_done("r1")
    assert lt.stats["unknown_done"] == 1
    assert lt.loads(["a"]) == [1.0] and lt.unprefilled("a") == 500
    lt.on_done("r2")
    assert lt.loads(["a"], disaggregated=True) == [0.0] and len(lt) == 0


def test_rerouting_the_same_id_moves_it():
    lt = LoadTracker()
    lt.on_route("r", "a", 10)
    lt.on_route("r", "b", 10)
    assert lt.loads(["a", "b"]) == [0.0, 1.0]
    assert lt.instance_of("r") == "b"


def test_engine_metrics_heal_lost_dones_oldest_first_after_grace():
    clock = Clock()
    lt = LoadTracker(clock)
    for k in range(4):
        clock.t = k
        lt.on_route(f"r{k}", "a", 10)
    clock.t = 10
    assert lt.reconcile("a", 1, grace_s=30) == 0  # too young to be called lost
    clock.t = 32.5  # r0..r2 are past the grace period, r3 is not
    assert lt.reconcile("a", 1, grace_s=30) == 3
    assert lt.instance_of("r0") is None and lt.instance_of("r3") == "a"
    assert lt.loads(["a"]) == [1.0]


def test_external_requests_count_as_load():
    lt = LoadTracker()
    lt.add_instance("a")
    lt.on_route("r", "a", 10)
    lt.reconcile("a", 5)
    assert lt.in_flight("a") == 5 and lt.loads(["a"]) == [5.0]
    lt.remove_instance("a")
    assert lt.loads(["a"]) == [0.0] and len(lt) == 0


def test_reconcile_counts_external_load_on_an_instance_never_routed_to():
    lt = LoadTracker()
    assert lt.reconcile("fresh", 3) == 0
    assert lt.loads(["fresh"]) == [3]


def test_loads_laid_out_in_the_index_order_track_every_change():
    """The router's fast path (a list kept in the index's order) must equal the per-instance lookup
    after any mix of routes, dones, reconciles and removals, and re-layout when the order changes."""
    import random

    rng = random.Random(3)
    t = LoadTracker(clock=lambda: 0.0)
    order = [f"i{k}" for k in range(6)]
    key = (1, 0)
    live: list[str] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.45:
            rid = f"r{step}"
            t.on_route(rid, rng.choice(order + ["elsewhere"]), 100, 10)
            live.append(rid)
        elif op < 0.8 and live:
            t.on_done(live.pop(rng.randrange(len(live))))
        elif op < 0.9:
            t.reconcile(rng.choice(order), rng.randrange(5), grace_s=-1.0)
        elif op < 0.95:
            t.remove_instance(rng.choice(order))
        else:  # the index's membership changes: a new instance joins the order
            order = order + [f"j{step}"]
            key = (1, key[1] + 1)
        assert t.aligned(order, key).dense() == t.loads(order), step
        # the O(1) answers a route uses: the sum and the least loaded with rr_argmin's tie-breaking
        view, want = t.aligned(order, key), t.loads(order)
        assert view.total() == sum(want), step
        assert [view.least(rr) for rr in range(3)] == [rr_argmin(want, rr) for rr in range(3)], step


def test_a_removed_instance_is_forgotten_in_slices_and_its_entries_are_dead_meanwhile():
    lt = LoadTracker()
    for k in range(10):
        lt.on_route(f"a{k}", "a", 100)
        lt.on_route(f"b{k}", "b", 100)
    lt.remove_instance("a", budget=3)
    assert len(lt) == 10 and lt.draining == 7  # 3 forgotten now, 7 left for later slices
    assert not lt.on_done("a9") and lt.stats["unknown_done"] == 1  # dead: not released twice
    assert not lt.on_prefilled("a8") and lt.instance_of("a7") is None
    lt.on_route("a8", "a", 50)  # the instance is back; a dead id routed again is a new entry
    assert lt.loads(["a", "b"]) == [1.0, 10.0] and lt.unprefilled("a") == 50 and len(lt) == 11
    while lt.drain(2):
        pass
    assert lt.draining == 0 and len(lt) == 11 and lt.instance_of("a8") == "a"
    assert lt.on_done("a8") and lt.loads(["a"]) == [0.0]


def test_a_reconcile_in_slices_ends_where_one_call_does():
    def tracker():
        clock = Clock()
        lt = LoadTracker(clock=clock)
        for k in range(500):
            clock.t = k * 0.01
            lt.on_route(f"r{k}", "a", 10)
        clock.t = 100.0
        lt.on_route("young", "a", 10)
        return lt

    one, sliced = tracker(), tracker()
    healed = one.reconcile("a", 20, grace_s=30.0, engine_waiting=5)
    assert not one.reconcile_left
    total, calls = sliced.reconcile("a", 20, grace_s=30.0, engine_waiting=5, budget=64), 1
    while sliced.reconcile_left:
        total += sliced.reconcile("a", 20, grace_s=30.0, engine_waiting=5, budget=64)
        calls += 1
    assert healed == total == 481 and calls == 8  # 481 / 64 entries a slice
    assert sliced.loads(["a"]) == one.loads(["a"]) == [20.0]
    assert sliced.unprefilled("a") == one.unprefilled("a") and sliced.stats == one.stats


def test_expiry_churn_does_not_pile_up_young_gc_objects():
    # A GC-tracked record per route, freed by expiry as new ones come, keeps the generation-0
    # count (allocations minus deallocations) under its threshold: the young generation then
    # grew to every record of the last ``expire_s`` and one collection stalled the loop ~100 ms.
    clock = Clock()
    lt = LoadTracker(clock, expire_s=5.0)

    def step(k):
        clock.t = k / 1000
        lt.on_route(f"r{k}", "a", 256)
        lt.on_done(f"r{k}")

    young = young_after_churn(step)
    assert lt.stats["routed"] == 20_000 and len(lt) == 0
    assert young < 2_000, f"{young} young GC objects: expiry records are GC-tracked"


def test_entries_expire_by_age_and_a_rerouted_id_only_once():
    clock = Clock()
    lt = LoadTracker(clock, expire_s=10.0)
    lt.on_route("r1", "a", 10)
    clock.t = 5.0
    lt.on_route("r2", "a", 10)
    lt.on_route("r1", "b", 10)  # re-routed: its first queue record is stale
    clock.t = 12.0
    assert lt.expire() == 0
    clock.t = 15.5
    assert lt.expire() == 2 and len(lt) == 0 and lt.loads(["a", "b"]) == [0, 0]


def test_a_done_request_keeps_nothing_until_expiry():
    # An age queue of every route kept each done request's entry for ``expire_s`` (~120 B each:
    # 20 MB at 5 k routes/s), churning pymalloc arenas that long-lived objects then pinned.
    import tracemalloc

    clock = Clock()
    lt = LoadTracker(clock, expire_s=30.0)
    lt.on_route("warm", "a", 256)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for k in range(20_000):
        clock.t = k / 1000  # 20 s: within expire_s, nothing expires
        lt.on_route(f"r{k}", "a", 256)
        lt.on_done(f"r{k}")
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert lt.stats["done"] == 20_000 and len(lt) == 1 and lt.stats["expired"] == 0
    assert kept / 20_000 < 4, f"{kept / 20_000:.1f} B kept per done request"


def test_a_lost_request_expires_within_one_cohort_of_expire_s():
    clock = Clock()
    lt = LoadTracker(clock, expire_s=32.0)  # cohorts of 1 s
    for k in range(100):
        clock.t = k / 10
        lt.on_route(f"r{k}", "a", 10)
    clock.t = 32.0
    assert not lt.expire_due() and lt.expire() == 0  # none older than expire_s yet
    clock.t = 41.9 + 1.0  # every entry is older than expire_s + one cohort
    while lt.expire_due():
        lt.expire()
    assert len(lt) == 0 and lt.stats["expired"] == 100
    # Between: entries leave with their cohort, never earlier than expire_s after their route.
    lt2 = LoadTracker(clock, expire_s=32.0)
    for k in range(100):
        clock.t = k / 10
        lt2.on_route(f"r{k}", "a", 10)
    clock.t = 37.05
    lt2.expire()
    gone = 100 - len(lt2)
    assert gone > 0 and all(lt2.instance_of(f"r{k}") is None for k in range(gone))
    assert all(k / 10 < 37.05 - 32.0 for k in range(gone))


def test_expiry_runs_in_slices_and_says_when_entries_are_due():
    clock = Clock()
    lt = LoadTracker(clock, expire_s=10.0)
    for k in range(5_000):
        lt.on_route(f"r{k}", "a", 10)
    assert not lt.expire_due()
    clock.t = 11.0  # an idle spell: every entry is due at once
    assert lt.expire_due()
    assert lt.expire(budget=2_048) == 2_048 and len(lt) == 2_952
    lt.on_route("late", "a", 10)  # a route expires a few more, never the whole backlog
    assert len(lt) == 2_952 + 1 - 8
    while lt.expire_due():
        lt.expire()
    assert len(lt) == 1 and lt.loads(["a"]) == [1] and lt.stats["expired"] == 5_000
