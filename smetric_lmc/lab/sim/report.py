"""Markdown tables and reports of simulation results."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from smetric_lmc.lab.sim.metrics import SimResult
from smetric_lmc.lab.sim.sweep import SweepResult


def default_out_dir() -> Path:
    """Where ``smetric sim`` writes its report, summaries and plots without ``--out``: a new folder
    per run under ./out (the repository ignores it)."""
    return Path("out") / time.strftime("sim-%Y%m%d-%H%M%S", time.gmtime())


def _f(x: Any, nd: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{nd}f}"
    return str(x)


# Our rules (the paper's and its variants); every other registered policy is a baseline users compare
# against (load_balance, bailian, lmetric, dynamo, round_robin, cache_first).
OUR_POLICIES = ("smetric", "smetric_ect", "smetric_ect_fixed")


def best_of_baselines(scores: Mapping[str, float]) -> tuple[str | None, float]:
    """The best baseline (not one of OUR_POLICIES) and its score."""
    base = {p: s for p, s in scores.items() if p not in OUR_POLICIES and not math.isnan(s)}
    if not base:
        return None, float("nan")
    p = max(base, key=lambda k: base[k])
    return p, base[p]


def slo_line(cfg: Any) -> str:
    """The SLO the 'TPS in SLO' figures are measured against, in words (``cfg``: a SimConfig)."""
    slo = cfg.slo
    return (f"SLO: TTFT <= {slo.ttft_base_s:g} s + {slo.ttft_per_token_s * 1000:g} ms per prompt token, "
            f"TPOT <= {slo.tpot_s * 1000:g} ms; 'TPS in SLO' counts the tokens/s of requests meeting both")


def headline(results: Mapping[str, SimResult], ours: str = "smetric") -> str:
    """smetric against the best BASELINE (never against our own variants), saying which one it is;
    our variants get their own ratios; a variant that made exactly the baseline's choices says why."""
    scores = {p: r.score for p, r in results.items()}
    name, best = best_of_baselines(scores)
    lines = []
    unit = "prefill TPS in SLO" if any(r.summary.get("pd") for r in results.values()) else "TPS in SLO"
    if name is None or not best:
        lines.append("no baseline among the policies run: nothing to compare against")
    else:
        for p in (q for q in OUR_POLICIES if q in scores):
            tag = f"{p} vs the best baseline ({name}, {_f(best)} tok/s)" if p == ours else f"  our variant {p}"
            lines.append(f"{tag}: {scores[p] / best:.3f}x {unit}")
    same = [(v, b) for v in OUR_POLICIES if v != ours and v in results for b in results
            if b not in OUR_POLICIES and _same_run(results[v], results[b])]
    for v, b in same:
        why = _SAME_AS.get((v, b), "it made the same choice for every request")
        lines.append(f"  note: {v} equals {b} here: {why}")
    return "\n".join(lines)


def _same_run(a: SimResult, b: SimResult) -> bool:
    """The two runs served every request on the same instance at the same times (reasons aside)."""
    keys = ("tps_slo", "slo_attainment", "ttft_p99", "hit_local")
    if any(a.summary.get(k) != b.summary.get(k) for k in keys):
        return False
    ca, cb = a.cols.get("instance"), b.cols.get("instance")
    if ca is None or cb is None:
        return True
    return bool(len(ca) == len(cb) and (ca == cb).all() and (a.cols["finish"] == b.cols["finish"]).all())


# Why a variant's row can equal a baseline's, when it does (policy docstrings give the derivation).
_SAME_AS = {
    ("smetric_ect", "lmetric"): "with none of a prompt in the global tier (here: global tier none, or the prefix "
                                "not yet stored) its cost is t_tok x (L - c) x (1 + l), LMetric's score times the "
                                "prefill cost per token, so it picks the same instance (policy/smetric_ect.py)",
}


def _ms(x: Any) -> Any:
    return x * 1000 if isinstance(x, float) else x


def comparison_table(results: Mapping[str, SimResult]) -> str:
    """One row per policy: TPS within SLO (and against the best baseline), hits, balance, latency;
    every column header names its unit."""
    if not results:
        return "(no results)\n"
    pd = next(iter(results.values())).summary.get("pd", False)
    scores = {p: r.score for p, r in results.items()}
    _, best = best_of_baselines(scores)
    head = [
        "policy", "prefill TPS in SLO (tok/s)" if pd else "TPS in SLO (tok/s)", "vs best baseline (x)",
        "SLO met (share)", "local hit (share)", "global hit (share)", "miss (share)", "max/mean load (x)",
        "sticky (share)", "TTFT p50 (s)", "TTFT p99 (s)", "TPOT p50 (ms)", "TPOT p99 (ms)",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, r in results.items():
        s = r.summary
        rel = r.score / best if best and not math.isnan(best) else float("nan")
        row = [
            p, _f(r.score), _f(rel), _f(s.get("slo_attainment")), _f(s.get("hit_local")),
            _f(s.get("hit_global")), _f(s.get("hit_miss")), _f(s.get("imbalance_mean")), _f(s.get("stickiness")),
            _f(s.get("ttft_p50")), _f(s.get("ttft_p99")), _f(_ms(s.get("tpot_p50")), 1), _f(_ms(s.get("tpot_p99")), 1),
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
