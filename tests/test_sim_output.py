"""Issue 21 item 7: `smetric sim`'s output says what it compares and in which units.

The headline compares smetric with the best BASELINE (never our own variants) and names it; the
table's headers carry units; the SLO is stated; a variant that made exactly a baseline's choices
says why; results land in a folder by default and the run says where.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from smetric_lmc.lab.sim.metrics import SimResult
from smetric_lmc.lab.sim.report import OUR_POLICIES, comparison_table, headline


def _result(policy: str, tps: float) -> SimResult:
    summary = {"policy": policy, "pd": False, "tps_slo": tps, "slo_attainment": 0.9, "ttft_p99": 1.5,
               "hit_local": 0.5, "tpot_p50": 0.012}
    return SimResult(policy, summary, np.empty(0), np.empty(0), np.empty((0, 0)))


def test_headline_is_against_the_best_baseline_not_our_variant() -> None:
    # our variant smetric_ect is the best other policy; the best baseline is lmetric
    res = {p: _result(p, t) for p, t in
           (("smetric", 1150.0), ("smetric_ect", 1091.0), ("lmetric", 1000.0), ("load_balance", 800.0))}
    text = headline(res)
    assert "smetric vs the best baseline (lmetric" in text and "1.150x" in text
    assert "our variant smetric_ect: 1.091x" in text
    table = comparison_table(res)
    assert "| lmetric | 1,000 | 1.00 |" in table and "| smetric | 1,150 | 1.15 |" in table


def test_sim_run_states_slo_units_baseline_and_writes_its_results(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "smetric_lmc.cli", "sim", "--sessions", "8", "--instances", "4",
                          "--policies", "smetric,smetric_ect,lmetric,load_balance", "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"SLO: TTFT <= [\d.]+ s \+ [\d.]+ ms per prompt token, TPOT <= [\d.]+ ms", text)
    for header in ("TPS in SLO (tok/s)", "vs best baseline (x)", "TTFT p99 (s)", "TPOT p99 (ms)"):
        assert header in text, header
    summaries = json.loads(text.strip().splitlines()[-1])
    score = {p: s["tps_slo"] for p, s in summaries.items()}
    best = max((p for p in score if p not in OUR_POLICIES), key=score.__getitem__)
    assert f"smetric vs the best baseline ({best}," in text
    assert f"{score['smetric'] / score[best]:.3f}x" in text
    assert "best other" not in text
    # the note is for runs the report finds identical (its _same_run keys), not merely equal TPS in SLO
    same = ("tps_slo", "slo_attainment", "ttft_p99", "hit_local")
    if all(summaries["smetric_ect"][k] == summaries["lmetric"][k] for k in same):
        assert "note: smetric_ect equals lmetric here" in text
    reports = list((tmp_path / "out").glob("sim-*/report.md"))
    assert len(reports) == 1 and f"results: {reports[0].relative_to(tmp_path)}" in text
    assert "SLO: TTFT" in reports[0].read_text() and (reports[0].parent / "summaries.json").exists()
