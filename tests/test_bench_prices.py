"""bench/prices.py's fetch-axis part: Bailian's λ is chosen on the tuning seed and only that λ is judged."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import pytest
from helpers import load_bench

from smetric_lmc.lab.sim import regime_map
from smetric_lmc.lab.sim.knee import KneeResult
from smetric_lmc.lab.sim.metrics import SimResult
from smetric_lmc.lab.sim.profile import load_profile


def _bench() -> Any:
    return load_bench("prices")


def _knee(scores: dict[str, float]) -> KneeResult:
    empty = np.empty(0)
    return KneeResult(1.0, {p: SimResult(p, {"pd": False, "tps_slo": v}, empty, empty, empty) for p, v in scores.items()})


def test_bailian_is_judged_at_the_lambda_its_tuning_seed_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench()
    # On the tuning seed λ = 0.5 wins; on the judged seeds λ = 0.3 would have: judging at 0.3 would be
    # tuning on the evaluation.
    tuning = {"bailian": 80.0, "bailian λ=0.7": 90.0, "bailian λ=0.5": 120.0, "bailian λ=0.3": 100.0, "smetric": 1.0}
    judged = {"bailian": 50.0, "bailian λ=0.7": 60.0, "bailian λ=0.5": 110.0, "bailian λ=0.3": 200.0,
              "lmetric": 100.0, "load_balance": 90.0, "dynamo": 70.0, "smetric": 95.0,
              "smetric_ect": 121.0, "smetric_ect_fixed": 100.0}  # fmt: skip
    seen: list[tuple[int, ...]] = []

    def fake_run_map(spec: regime_map.MapSpec, base: Any, prof: Any, jobs: int = 1) -> regime_map.RegimeMap:
        seen.append(tuple(spec.seeds))
        tune = tuple(spec.seeds) == (bench.TUNE_SEED,)
        assert set(spec.policies) <= set(tuning if tune else judged)
        cells = [regime_map.Cell(0.3, t, 0.3, 1.0, 1000, [_knee(tuning if tune else judged) for _ in spec.seeds])
                 for t in spec.tiers]
        return regime_map.RegimeMap(spec, 1000, cells)

    monkeypatch.setattr(regime_map, "run_map", fake_run_map)
    a = argparse.Namespace(axis=(0.8,), x=0.3, tiers=("full",), map_instances=2, map_roots=30, map_window=60.0,
                           pilots=1, rate_factors=(1.0,), map_seeds=(0, 3), params={}, jobs=1, show_loads=False)
    (row,) = bench.fetch_axis(a, load_profile(bench.PROFILE))["cells"]
    assert seen == [(bench.TUNE_SEED,), (0, 3)] and bench.TUNE_SEED not in (0, 3)
    assert row["bailian_lambda"] == 0.5 and row["best_baseline"] == "bailian λ=0.5"
    assert row["vs_best"] == pytest.approx(121 / 110) and row["vs_bailian_tuned"] == pytest.approx(121 / 110)
    assert row["vs_lmetric"] == pytest.approx(1.21) and row["vs_best_seed_sd"] == pytest.approx(0.0)
    # the interval re-chooses the best among the judged baselines only (λ = 0.3's 200 is not one)
    assert row["vs_best_ci90"] == pytest.approx((121 / 110, 121 / 110))
    assert row["vs_fixed_ci90"] == pytest.approx((1.21, 1.21))
