"""Instances slower for a while (sim/slowdown.py): off by default, the same draws for every policy,
mean 1, and a slowed instance really takes longer."""

from __future__ import annotations

import numpy as np
import pytest

from smetric_lmc.lab.sim.config import SimConfig
from smetric_lmc.lab.sim.slowdown import Slowdown


def test_off_by_default_and_one_throughout() -> None:
    assert SimConfig().slowdown_cv == 0.0
    s = Slowdown(0.0, 30.0, seed=0, pos=3)
    assert {s.factor(t) for t in (0.0, 29.9, 30.0, 1e6)} == {1.0}


def test_draws_depend_on_seed_instance_and_epoch_only() -> None:
    a, b = Slowdown(0.3, 10.0, seed=1, pos=2), Slowdown(0.3, 10.0, seed=1, pos=2)
    times = [0.0, 5.0, 9.99, 10.0, 2500.0, 12.0]
    # asked in different orders (as two policies' events would), the same factor at the same time
    fa = [a.factor(t) for t in times]
    fb = {t: b.factor(t) for t in reversed(times)}
    assert fa == [fb[t] for t in times]
    assert fa[0] == fa[1] == fa[2] != fa[3]  # constant within an epoch, redrawn at its end
    assert fa[3] == fa[5]
    assert Slowdown(0.3, 10.0, seed=1, pos=3).factor(0.0) != fa[0]  # another instance
    assert Slowdown(0.3, 10.0, seed=2, pos=2).factor(0.0) != fa[0]  # another seed


def test_factors_have_mean_one_and_the_asked_spread() -> None:
    s = Slowdown(0.3, 1.0, seed=0, pos=0)
    f = np.array([s.factor(float(t)) for t in range(20000)])
    assert f.mean() == pytest.approx(1.0, abs=0.01)
    assert f.std() / f.mean() == pytest.approx(0.3, abs=0.015)
    assert (f > 0).all()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Slowdown(-0.1, 10.0, 0, 0)
    with pytest.raises(ValueError):
        Slowdown(0.1, 0.0, 0, 0)


def test_a_slowed_instance_takes_its_factor_longer() -> None:
    """One instance, one session (its turns never queue behind another's): with a static factor f
    every prefill takes f times as long, so every TTFT does."""
    from smetric_lmc.config import PolicyConfig
    from smetric_lmc.lab.sim.cluster import Simulator
    from smetric_lmc.lab.sim.profile import load_profile
    from smetric_lmc.lab.workload.presets import preset_workload

    wl = preset_workload("trace1", 3, seed=3)
    prof = load_profile("qwen3-30b-a3b-h20")
    ttft = {}
    for cv in (0.0, 0.5):
        cfg = SimConfig(instances=1, rate=0.001, measure="run", slowdown_cv=cv, slowdown_period_s=1e9, seed=5)
        ttft[cv] = Simulator(wl, cfg, PolicyConfig(name="load_balance"), prof).run().ttft
    f = Slowdown(0.5, 1e9, seed=5, pos=0).factor(0.0)
    assert abs(f - 1) > 0.05 and len(ttft[0.0]) == len(ttft[0.5]) > 3
    assert np.median(ttft[0.5] / ttft[0.0]) == pytest.approx(f, rel=1e-3)


def test_the_config_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="slowdown"):
        SimConfig(slowdown_cv=-1.0)
    with pytest.raises(ValueError, match="slowdown"):
        SimConfig(slowdown_period_s=0.0)
