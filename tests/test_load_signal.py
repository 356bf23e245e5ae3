"""Load signals as real routers see them: exact router counts vs engine metrics scraped every N s."""

from __future__ import annotations

import pytest

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.cluster import Simulator
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.sim.load_signal import BatchLoadTracker, ScrapedLoadTracker
from smetric_lmc.lab.workload.presets import preset_workload


def test_scraped_loads_stay_stale_until_the_next_scrape() -> None:
    now = [0.0]
    t = ScrapedLoadTracker(lambda: now[0], scrape_s=5.0)
    for i in ("a", "b"):
        t.add_instance(i)
    assert t.loads(["a", "b"]) == [0, 0]  # scrape at t=0
    for k in range(3):
        now[0] = 1.0 + k
        t.on_route(f"r{k}", "a", 1000)
    # routed since the scrape: invisible to the policy, so a least-loaded rule would herd onto "a"
    assert t.loads(["a", "b"]) == [0, 0] and t.in_flight("a") == 0 and t.unprefilled("a") == 0
    assert t.aligned(["a", "b"], (0, 0)).least(0) == 0
    assert t.true_loads(["a", "b"]) == [3, 0]
    now[0] = 5.0
    assert t.loads(["a", "b"]) == [3, 0] and t.unprefilled("a") == 3000
    t.on_done("r0")
    now[0] = 9.9
    assert t.loads(["a", "b"]) == [3, 0]
    now[0] = 10.0
    assert t.loads(["a", "b"]) == [2, 0]
    with pytest.raises(ValueError):
        ScrapedLoadTracker(lambda: 0.0, scrape_s=0.0)


def test_stale_load_herds_a_least_loaded_router() -> None:
    """Same workload, same policy: scraping every 30 s spreads requests worse than exact counts
    (the routing-time in-flight imbalance is measured on the true loads)."""
    wl = preset_workload("weka", 24, seed=3)
    out = {}
    for signal in ("router", "scrape"):
        cfg = load_sim_config(instances=4, rate=0.2, seed=3, global_tier="none", load_signal=signal, scrape_s=30.0)
        sim = Simulator(wl, cfg, PolicyConfig(name="load_balance"))
        res = sim.run()
        out[signal] = res.summary["inflight_imbalance_mean"]
        if signal == "scrape":
            assert sim.load.scrapes > 1  # type: ignore[attr-defined]
    assert out["scrape"] > out["router"]


def test_batch_load_sees_the_running_batch_not_the_queue() -> None:
    batch = {"a": 2, "b": 5}
    t = BatchLoadTracker(lambda: 0.0, batch.__getitem__)
    for i in ("a", "b"):
        t.add_instance(i)
    for k in range(4):
        t.on_route(f"r{k}", "a", 1000)  # four routed to "a", two of them admitted
    assert t.loads(["a", "b"]) == [2, 5] and t.loads(["a", "b"], disaggregated=True) == [2, 5]
    assert t.in_flight("a") == 2 and t.aligned(["a", "b"], (0, 0)).least(0) == 0
    assert t.unprefilled("a") == 4000  # the router's own books stay (Dynamo reads them)


def test_listed_policies_read_the_engines_batch() -> None:
    wl = preset_workload("weka", 6, seed=3)
    cfg = load_sim_config(instances=2, rate=0.2, seed=3, global_tier="none", batch_load_policies=("bailian",))
    sim = Simulator(wl, cfg, PolicyConfig(name="bailian"))
    assert isinstance(sim.load, BatchLoadTracker)
    assert sim.load.loads(["i000", "i001"]) == [0, 0]
    assert sim.run().summary["requests"] > 0
    assert not isinstance(Simulator(wl, cfg, PolicyConfig(name="lmetric")).load, BatchLoadTracker)
