"""Load signals as real routers see them: exact router counts vs engine metrics scraped every N s."""

from __future__ import annotations

import pytest

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.cluster import Simulator
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.sim.load_signal import ScrapedLoadTracker
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
