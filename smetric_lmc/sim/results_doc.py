"""``smetric sim report``: the WEKA results document (docs/results.md).

Three settings on the WEKA Claude Code trace, 32 instances: with a global tier, without one, and PD
disaggregation (with the global tier). In each, every policy runs over an offered-load sweep and is
credited with its best TPS within SLO. Then a sensitivity check of the profile's constants. The
command ends by printing one JSON line with SMetric's ratio to the best baseline in each setting.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from smetric_lmc.config import POLICY_NAMES, PolicyConfig
from smetric_lmc.sim.config import SimConfig, load_sim_config
from smetric_lmc.sim.metrics import SimResult
from smetric_lmc.sim.profile import Profile, load_profile
from smetric_lmc.sim.report import (
    best_baseline,
    best_per_policy,
    comparison_table,
    load_table,
    ratio_vs_best,
    reasons_table,
    sweep_table,
)
from smetric_lmc.sim.sweep import Point, SweepResult, replace_cfg, run_points, sweep
from smetric_lmc.workload.model import Workload

log = logging.getLogger(__name__)

DEFAULT_RATES = (0.02, 0.035, 0.05, 0.08)
SENSITIVITY = (
    ("compute_eff 0.4", {"compute_eff": 0.4}),
    ("compute_eff 0.8", {"compute_eff": 0.8}),
    ("mem_eff 0.6", {"mem_eff": 0.6}),
    ("local CPU tier 20 GiB", {"local_cpu_gib": 20.0}),
    ("link 100 Gb/s", {"link_gbps": 100.0}),
)

PAPER = {
    "global": "+10–16% TPS within SLO over the best baseline (with a global store)",
    "noglobal": "≈ equal to the best baseline (no global store)",
    "pd": "+2–34% prefill TPS within SLO (PD disaggregation)",
    "stickiness": "96.6% of follow-ups on their first-turn instance under cache-first, 4.0% under load balance",
    "hits": "local-tier hit 64% (SMetric) vs 65% (most cache-greedy baseline)",
    "imbalance": "max/mean load 2.6× (SMetric) vs 3.0× (Bailian), 3.2× (LMetric)",
}


def shared_dir() -> Path:
    """$SMETRIC_SHARED, else ``../shared`` from the working directory (run from a checkout)."""
    return Path(os.environ.get("SMETRIC_SHARED", Path("..") / "shared"))


def _settings(base: SimConfig, global_tier: str) -> list[tuple[str, str, SimConfig]]:
    return [
        ("global", f"global tier {global_tier}", replace_cfg(base, global_tier=global_tier, pd=False)),
        ("noglobal", "no global tier", replace_cfg(base, global_tier="none", pd=False)),
        ("pd", f"PD disaggregation, global tier {global_tier}", replace_cfg(base, global_tier=global_tier, pd=True)),
    ]


def _fmt_ratio(x: float) -> str:
    return "–" if x != x else f"{x:.3f}"


def _discussion(ratios: dict[str, float], best: dict[str, dict[str, SimResult]]) -> str:
    lines = []
    g, n, p = ratios.get("global", math.nan), ratios.get("noglobal", math.nan), ratios.get("pd", math.nan)
    lines.append(
        f"- With a global tier SMetric reaches {_fmt_ratio(g)}× the best baseline's max TPS within SLO "
        f"(target ≥ 1.10; paper: 1.10–1.16×). Without one: {_fmt_ratio(n)}× (target ≥ 0.99; paper ≈ 1.0). "
        f"PD disaggregation: {_fmt_ratio(p)}× prefill TPS within SLO (paper: 1.02–1.34×)."
    )
    for key, res in best.items():
        if "smetric" not in res:
            continue
        s = res["smetric"].summary
        bname, _ = best_baseline({k: v.score for k, v in res.items()})
        if bname is None:
            continue
        b = res[bname].summary
        lines.append(
            f"- {key}: SMetric local hit {s['hit_local']:.1%} / global {s['hit_global']:.1%} / miss "
            f"{s['hit_miss']:.1%}, imbalance {s['imbalance_mean']:.2f}, stickiness {s['stickiness']:.1%}; "
            f"best baseline {bname}: local {b['hit_local']:.1%} / global {b['hit_global']:.1%} / miss "
            f"{b['hit_miss']:.1%}, imbalance {b['imbalance_mean']:.2f}, stickiness {b['stickiness']:.1%}."
        )
    return "\n".join(lines) + "\n"


def _model_notes(prof: Profile, bs: int) -> str:
    kv = prof.gpu_capacity_blocks(bs) * bs
    t100k = prof.iteration_time([(100_000, 0)], 0, 0)
    link = prof.link_bytes_per_s / prof.instances_per_node
    fetch100k = 100_000 * prof.kv_bytes_per_token / link
    return (
        "\nWhat drives these numbers in the model (true of every run above):\n\n"
        f"- The local tier is small next to agent contexts: one instance holds {kv:,} KV tokens, while a WEKA "
        "prompt averages ~123k tokens. An instance keeps the KV of about two sessions, so under load most "
        "sessions are evicted between turns whatever the policy; stickiness pays only while the KV survives "
        "the think time, and SMetric's evicted path (best hit < HIT_RATIO × est_hit) then balances.\n"
        f"- A miss is expensive: recomputing a 100k-token prompt takes {t100k:.0f} s on one instance "
        "(attention over the long context dominates the FLOPs), while fetching it from the global tier takes "
        f"{fetch100k:.1f} s at a fair share of the node link. A global tier therefore turns a lost session "
        "from a recompute into a fetch, which is what lets a balancing decision be cheap.\n"
        "- Requests over the context limit are rejected for all policies alike; the sessions that grow "
        "past it stop contributing, which removes the heaviest prompts from the comparison.\n"
        "- No cross-session system-prompt sharing (the trace's ids are per conversation), so cache-aware "
        "policies cannot herd on a shared prefix here the way they do in production; the synthetic "
        "workload (shared framework prompt) shows that effect.\n"
    )


def build_document(
    wl: Workload,
    base: SimConfig,
    prof: Profile,
    sweeps: dict[str, tuple[str, SweepResult]],
    sens_rows: list[tuple[str, float, str, float]],
    elapsed: float,
    knob_sweeps: list[tuple[str, SweepResult]] | None = None,
) -> tuple[str, dict[str, float]]:
    best = {k: best_per_policy(sw) for k, (_, sw) in sweeps.items()}
    ratios = {k: ratio_vs_best({p: r.score for p, r in b.items()}) for k, b in best.items()}
    md: list[str] = [
        "# Simulated results: SMetric vs baselines on the WEKA Claude Code trace\n",
        "Generated by `smetric sim report` (the trace-driven simulator, docs/simulator.md). Trace: "
        "WEKA Claude Code sessions (`callanjfox/kv-cache-tester`, Apache-2.0), "
        f"{wl.n_requests} requests in {len(wl.sessions)} sessions"
        + (f" (first {base.max_sessions} root sessions of a seeded random order)" if base.max_sessions else "")
        + ". Block ids are local to each conversation (no cross-session system-prompt sharing"
        + (", except the shared-prefix mapping requested" if wl.meta.get("shared_prefix") else "")
        + ").\n",
        f"Cluster: {base.instances} instances, profile `{prof.name}` (TP {prof.tp}, "
        f"{prof.gpu_capacity_blocks(wl.block_size) * wl.block_size:,} KV tokens per instance, "
        f"{prof.instances_per_node} instances per node sharing a {prof.link_gbps:g} Gb/s link). "
        f"Closed-loop sessions (think times clipped at {base.max_think_s:g} s), Poisson session starts. "
        f"SLO: TTFT ≤ {base.slo.ttft_base_s:g} s + {base.slo.ttft_per_token_s:g} s × input tokens, "
        f"TPOT ≤ {base.slo.tpot_s * 1000:g} ms. TPS counts {base.tps_tokens} tokens of requests meeting both, "
        f"over the session-arrival period. Requests longer than the model's context "
        f"({prof.max_model_len:,} tokens) are rejected for every policy alike.\n",
        "## Headline: max TPS within SLO vs the best baseline\n",
        "| setting | SMetric / best baseline | best baseline | paper |",
        "|---|---|---|---|",
    ]
    for key, (label, _) in sweeps.items():
        bname, _ = best_baseline({p: r.score for p, r in best[key].items()})
        md.append(f"| {label} | {_fmt_ratio(ratios[key])} | {bname} | {PAPER[key]} |")
    md.append("")
    for key, (label, sw) in sweeps.items():
        md += [f"## {label}\n", "Each policy at its best offered load:\n", comparison_table(best[key]),
               "Route reasons:\n", reasons_table(best[key]),
               "Score over the offered-load sweep (sessions/s):\n", load_table(sw)]  # fmt: skip
        rej = next(iter(best[key].values())).summary.get("rejected_input_share", 0.0)
        md.append(f"Rejected (over the context limit): {rej:.1%} of input tokens.\n")
    md += ["## Side by side with the paper\n", "| quantity | paper | this simulation |", "|---|---|---|"]
    g = best.get("global", {})
    if "smetric" in g:
        s = g["smetric"].summary
        cf = g.get("cache_first")
        lb = g.get("load_balance")
        md.append(f"| stickiness | {PAPER['stickiness']} | cache-first {cf.summary['stickiness']:.1%}, load balance "
                  f"{lb.summary['stickiness']:.1%}, SMetric {s['stickiness']:.1%} |" if cf and lb else "")  # fmt: skip
        greedy = max((r for p, r in g.items() if p != "smetric"), key=lambda r: r.summary["hit_local"])
        md.append(f"| local-tier hit | {PAPER['hits']} | SMetric {s['hit_local']:.1%} vs {greedy.policy} "
                  f"{greedy.summary['hit_local']:.1%} |")  # fmt: skip
        imb = ", ".join(f"{p} {r.summary['imbalance_mean']:.2f}×" for p, r in g.items())
        md.append(f"| max/mean load | {PAPER['imbalance']} | {imb} |")
    md.append("")
    md += ["## Discussion\n", _discussion(ratios, best), _model_notes(prof, wl.block_size)]
    for label, sw in knob_sweeps or []:
        md += [f"## SMetric's {sw.knob.upper()} ({label})\n", sweep_table(sw)]
    if sens_rows:
        md += [
            "## Sensitivity to the profile's constants\n",
            "SMetric and the best baseline of the global-tier setting, rerun at that setting's best load "
            "with one constant changed:\n",
            "| change | SMetric | best baseline | baseline score | ratio |",
            "|---|---|---|---|---|",
        ]
        for label, s_score, bname, b_score in sens_rows:
            r = s_score / b_score if b_score else math.nan
            md.append(f"| {label} | {s_score:,.0f} | {bname} | {b_score:,.0f} | {_fmt_ratio(r)} |")
        md.append("")
    md.append(f"_Simulation time: {elapsed / 60:.0f} min on one machine._\n")
    return "\n".join(md), ratios


def main_report(args: argparse.Namespace) -> int:
    trace = Path(args.trace) if args.trace else shared_dir() / "traces" / "weka-claude-code.tar.xz"
    if not trace.exists():
        print(f"trace not found: {trace} (set SMETRIC_SHARED or pass --trace)")
        return 2
    from smetric_lmc.workload import load_any

    wl = load_any(trace, shared_prefix=args.shared_prefix)
    base = load_sim_config(args.config, profile=args.profile, instances=args.instances or 32, seed=args.seed,
                           max_sessions=args.sessions, arrival=args.arrival)  # fmt: skip
    prof = load_profile(args.profile or base.profile)
    pols = [p.strip() for p in args.policies.split(",")] if args.policies else list(POLICY_NAMES)
    rates = [float(x) for x in args.rates.split(",")] if args.rates else list(DEFAULT_RATES)
    # Offered load is sessions/s: a subset of sessions keeps the same concurrency, over a shorter period.
    gtier = args.global_tier or "full"
    t0 = time.perf_counter()
    sweeps: dict[str, tuple[str, SweepResult]] = {}
    for key, label, cfg in _settings(base, gtier):
        log.info("setting: %s", label)
        sweeps[key] = (label, sweep(wl, "load", cfg, pols, rates, profile=prof, jobs=args.jobs))
    sens_rows: list[tuple[str, float, str, float]] = []
    g_best = best_per_policy(sweeps["global"][1])
    bname, _ = best_baseline({p: r.score for p, r in g_best.items()})
    if "smetric" in g_best and bname is not None:
        rate_s = g_best["smetric"].summary["rate"]
        rate_b = g_best[bname].summary["rate"]
        cfg_g = _settings(base, gtier)[0][2]
        for label, over in SENSITIVITY:
            p2 = prof.with_overrides(**over)
            pts = [Point("sens", label, replace_cfg(cfg_g, rate=rate_s), PolicyConfig(name="smetric")),
                   Point("sens", label, replace_cfg(cfg_g, rate=rate_b), PolicyConfig(name=bname))]  # type: ignore[arg-type]  # fmt: skip
            rs = run_points(wl, pts, p2, args.jobs, desc=f"sensitivity {label}")
            sens_rows.append((label, rs[0].score, bname, rs[1].score))
    knob_sweeps: list[tuple[str, SweepResult]] = []
    for key in ("noglobal", "global"):
        b = best_per_policy(sweeps[key][1])
        if "smetric" not in b:
            continue
        cfg_k = next(c for k, _, c in _settings(base, gtier) if k == key)
        rate_k = b["smetric"].summary["rate"]
        for knob in ("overload", "hit_ratio"):
            sw = sweep(wl, knob, cfg_k, ["smetric"], [rate_k], profile=prof, jobs=args.jobs)
            knob_sweeps.append((f"{sweeps[key][0]}, {rate_k:g} sessions/s", sw))
    doc, ratios = build_document(wl, base, prof, sweeps, sens_rows, time.perf_counter() - t0, knob_sweeps)
    out = Path(args.out) if args.out else Path("docs") / "results.md"  # run from the checkout it documents
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    print(doc)
    print(f"wrote {out}")
    summary: dict[str, Any] = {
        "smetric_vs_best_global": round(ratios.get("global", math.nan), 4),
        "smetric_vs_best_noglobal": round(ratios.get("noglobal", math.nan), 4),
        "smetric_vs_best_pd": round(ratios.get("pd", math.nan), 4),
    }
    print(json.dumps(summary))
    return 0
