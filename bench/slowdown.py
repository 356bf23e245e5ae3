"""The paper's four methods at their knee with instances that differ in speed (a probe of one
mechanism the paper reproduction may lack; docs/paper-gpu-variation.md).

    python bench/slowdown.py --cv 0.08 --period-s inf             # a fixed factor per instance
    python bench/slowdown.py --cv 0.3 --period-s 30 --settings full,pd
    python bench/slowdown.py --cv 0 --lmetric-offset 1            # the model without it; our port's LMetric

Runs `smetric sim paper`'s full-size setup (32 instances, the trace1 preset, judged seed 0) for
load-balance-only, Bailian (lambda 0.5, its tuned value in every setting of docs/paper.md),
LMetric (the paper's formula, load offset 0, unless --lmetric-offset) and SMetric at its defaults:
each one's knee search, then its peak's TPS within SLO, load imbalance (the paper's: in-flight
tokens, max/mean per minute over the first 10 minutes), local and global hit and stickiness.
Prints one line per setting and policy, then ONE JSON line:
``{"cv", "period_s", "wall_s", "rows": {"<setting>/<policy>": {...}}}``.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import msgspec

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim import paper
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.sim.knee import Setting, knee_sweeps
from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.workload.presets import preset_workload

POLICIES = ("load_balance", "bailian", "lmetric", "smetric")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cv", type=float, default=0.08, help="coefficient of variation of the step-time factor")
    ap.add_argument("--period-s", type=float, default=math.inf, help="how often it is redrawn (inf: fixed)")
    ap.add_argument("--settings", default="full", help=f"comma list of {', '.join((*paper.TIERS, paper.PD_KEY))}")
    ap.add_argument("--lmetric-offset", type=float, default=0.0, help="LMetric's load offset (0: the paper's)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    keys = args.settings.split(",")
    if unknown := set(keys) - {*paper.TIERS, paper.PD_KEY}:
        ap.error(f"unknown settings: {', '.join(sorted(unknown))}")
    size = paper.FULL
    prof = load_profile("qwen3-30b-a3b-h20")
    try:
        base = msgspec.structs.replace(load_sim_config(None), slowdown_cv=args.cv, slowdown_period_s=args.period_s)
        base.__post_init__()
    except ValueError as exc:
        ap.error(str(exc))
    limit = int(0.9 * prof.max_context(64))
    wls = {"seed0": preset_workload("trace1", size.roots, seed=size.eval_seed, context_limit=limit)}
    pols = [PolicyConfig(name="load_balance"), PolicyConfig(name="bailian", bailian_lambda=0.5),
            PolicyConfig(name="lmetric", lmetric_load_offset=args.lmetric_offset), PolicyConfig(name="smetric")]
    settings = {k: Setting("seed0", paper._cfg(base, size, k, size.eval_seed), prof) for k in keys}
    t0 = time.perf_counter()
    out = knee_sweeps(wls, settings, pols, PolicyConfig(name="smetric"), size.factors, args.jobs, size.pilots,
                      desc="slowdown", extend=size.extend, labels=list(POLICIES))
    rows: dict[str, dict[str, float]] = {}
    for k in keys:
        kr = out[k]
        for p in POLICIES:
            s = kr.summary(p)
            rows[f"{k}/{p}"] = row = {
                "tps_slo": round(kr.score(p)), "imbalance": round(float(s.get(paper.IMB, math.nan)), 3),
                "hit_local": round(float(s.get("hit_local", math.nan)), 3),
                "hit_global": round(float(s.get("hit_global", math.nan)), 3),
                "stickiness": round(float(s.get("stickiness", math.nan)), 3)}
            print(f"{paper.TIER_LABEL[k]:32s} {p:13s} TPS within SLO {row['tps_slo']:>9,}  imbalance "
                  f"{row['imbalance']:.2f}x  local hit {100 * row['hit_local']:.1f}%  stickiness "
                  f"{100 * row['stickiness']:.1f}%")
    print(json.dumps({"cv": args.cv, "period_s": args.period_s, "lmetric_offset": args.lmetric_offset,
                      "wall_s": round(time.perf_counter() - t0), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
