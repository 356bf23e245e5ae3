"""Markdown tables and reports of simulation results."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from smetric_lmc.sim.metrics import SimResult
from smetric_lmc.sim.sweep import SweepResult


def _f(x: Any, nd: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{nd}f}"
    return str(x)


def best_baseline(scores: Mapping[str, float], ours: str = "smetric") -> tuple[str | None, float]:
    base = {p: s for p, s in scores.items() if p != ours}
    if not base:
        return None, float("nan")
    p = max(base, key=lambda k: base[k])
    return p, base[p]


def ratio_vs_best(scores: Mapping[str, float], ours: str = "smetric") -> float:
    _, b = best_baseline(scores, ours)
    if ours not in scores or not b or math.isnan(b):
        return float("nan")
    return scores[ours] / b


def comparison_table(results: Mapping[str, SimResult]) -> str:
    """One row per policy: TPS within SLO (and vs the best other policy), hits, balance, latency."""
    if not results:
        return "(no results)\n"
    pd = next(iter(results.values())).summary.get("pd", False)
    scores = {p: r.score for p, r in results.items()}
    head = [
        "policy", "prefill TPS in SLO" if pd else "TPS in SLO", "vs best other", "SLO met",
        "local hit", "global hit", "miss", "max/mean load", "sticky", "TTFT p50", "TTFT p99",
        "TPOT p50", "TPOT p99",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, r in results.items():
        s = r.summary
        others = {k: v for k, v in scores.items() if k != p}
        best_other = max(others.values(), default=float("nan"))
        rel = r.score / best_other if best_other and not math.isnan(best_other) else float("nan")
        row = [
            p, _f(r.score), _f(rel), _f(s.get("slo_attainment")), _f(s.get("hit_local")),
            _f(s.get("hit_global")), _f(s.get("hit_miss")), _f(s.get("imbalance_mean")), _f(s.get("stickiness")),
            _f(s.get("ttft_p50")), _f(s.get("ttft_p99")), _f(s.get("tpot_p50"), 3), _f(s.get("tpot_p99"), 3),
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def reasons_table(results: Mapping[str, SimResult]) -> str:
    keys = sorted({k for r in results.values() for k in r.summary.get("reasons", {})})
    lines = ["| policy | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for p, r in results.items():
        rs = r.summary.get("reasons", {})
        tot = max(1, sum(rs.values()))
        lines.append(f"| {p} | " + " | ".join(f"{rs.get(k, 0) / tot:.1%}" for k in keys) + " |")
    return "\n".join(lines) + "\n"


def sweep_table(sw: SweepResult) -> str:
    """Max score per (knob value, policy) over the load points, and the load where it peaked."""
    best = sw.best()
    pols = sw.policies()
    lines = [f"| {sw.knob} | " + " | ".join(pols) + " |", "|" + "---|" * (len(pols) + 1)]
    for v in sw.values():
        cells = []
        for p in pols:
            o = best.get((v, p))
            cells.append("–" if o is None else f"{_f(o.result.score)} (@{o.point.cfg.rate:g}/s)")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def load_table(sw: SweepResult) -> str:
    pols = sw.policies()
    rates = sorted({o.point.cfg.rate for o in sw.outcomes})
    by = {(o.policy, o.point.cfg.rate): o.result.score for o in sw.outcomes}
    lines = ["| sessions/s | " + " | ".join(pols) + " |", "|" + "---|" * (len(pols) + 1)]
    for r in rates:
        lines.append(f"| {r:g} | " + " | ".join(_f(by.get((p, r))) for p in pols) + " |")
    return "\n".join(lines) + "\n"


def best_per_policy(sw: SweepResult) -> dict[str, SimResult]:
    """Each policy's best run over the load points (its max TPS within SLO)."""
    out: dict[str, SimResult] = {}
    for o in sw.outcomes:
        if o.policy not in out or o.result.score > out[o.policy].score:
            out[o.policy] = o.result
    return out


def sweep_section(sws: Sequence[SweepResult]) -> str:
    parts = []
    for sw in sws:
        parts.append(f"### Sweep: {sw.knob}\n")
        parts.append(load_table(sw) if sw.knob == "load" else sweep_table(sw))
    return "\n".join(parts)
