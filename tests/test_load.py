from smetric_lmc.load import LoadTracker


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
