"""`smetric sim`: the policy table, sweeps, plots and the report files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smetric_lmc.lab.sim import cli
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.sim.sweep import build_points, rates_around


def test_sim_cli_sweep_writes_report_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main([
        "--sessions", "4", "--instances", "2", "--policies", "smetric,load_balance",
        "--sweep", "load", "--rates", "0.01,0.04", "--out", str(tmp_path), "--json",
    ])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "| smetric |" in out and "| load_balance |" in out
    summaries = json.loads(out.strip().splitlines()[-1])
    assert set(summaries) == {"smetric", "load_balance"}
    # each policy is credited with its best point of the load sweep
    assert all(s["rate"] in (0.01, 0.04) for s in summaries.values())
    for name in ("report.md", "heatmap.png", "latency_cdf.png", "tps_vs_load.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "Sweep: load" in (tmp_path / "report.md").read_text()


def test_sweep_points() -> None:
    base = load_sim_config(instances=8, rate=0.1)
    pts = build_points("overload", base, ["smetric"], [0.1, 0.2])
    assert len(pts) == 5 * 2 and {p.policy.name for p in pts} == {"smetric"}
    assert sorted({p.policy.overload for p in pts})[-1] == float("inf")
    pts = build_points("instances", base, ["smetric", "load_balance"], [0.1], values=[4, 16])
    # offered load scales with the cluster size
    assert sorted((p.cfg.instances, p.cfg.rate) for p in pts if p.policy.name == "smetric") == [(4, 0.05), (16, 0.2)]
    pts = build_points("global", base, ["smetric"], [0.1])
    assert [p.cfg.global_tier for p in pts] == ["none", "0.4", "0.8", "1.6", "full"]
    r = rates_around(0.1, 5, 4.0)
    assert r[0] == pytest.approx(0.05) and r[-1] == pytest.approx(0.2) and r[2] == pytest.approx(0.1)
