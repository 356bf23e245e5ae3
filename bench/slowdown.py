"""The paper's four methods at their knee with instances that differ in speed (a probe of one
mechanism the paper reproduction may lack; docs/paper-gpu-variation.md).

    python bench/slowdown.py --cv 0.08 --period-s inf             # a fixed factor per instance
    python bench/slowdown.py --cv 0.3 --period-s 30 --settings full,pd
    python bench/slowdown.py --cv 0 --lmetric-offset 1            # the model without it; our port's LMetric
    python bench/slowdown.py --cv 0.15 --learn                     # what the learning router makes of it

Runs `smetric sim paper`'s full-size setup (32 instances, the trace1 preset, judged seed 0) for
load-balance-only, Bailian (lambda 0.5, its tuned value in every setting of docs/paper.md),
LMetric (the paper's formula, load offset 0, unless --lmetric-offset) and SMetric at its defaults:
each one's knee search, then its peak's TPS within SLO, load imbalance (the paper's: in-flight
tokens, max/mean per minute over the first 10 minutes), local and global hit and stickiness.
Prints one line per setting and policy, then ONE JSON line:
``{"cv", "period_s", "wall_s", "rows": {"<setting>/<policy>": {...}}}``.

``--learn``: does the learning variant (smetric_ect) see which instances are slower? (1) bench/prices.py
part 1's cluster (4 instances, the trace1 preset, a full global tier at 0.8 GB/s per request) with a
fixed factor per instance: each instance's own learned prefill price and the price its decisions
use, divided by the profile's true price, beside the instance's factor. (2) 8 instances (`sim paper
--quick`'s size, full tier, 1.6 GB/s) on the development seeds (--seeds; never 0, 3, 4, which
bench/prices.py judges on): the variant's knee score with its decisions on each instance's own
prices (``shrink_z`` 0) divided by the default's (shrink_z 2), per seed. ONE JSON line:
``{"cv", "instances": [{"factor", "own", "decision"}], "corr_own", "own_vs_shrunk": {seed: ratio}}``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics as st
import sys
import time
from pathlib import Path

import msgspec

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim import paper
from smetric_lmc.lab.sim.cluster import Simulator
from smetric_lmc.lab.sim.config import SimConfig, load_sim_config
from smetric_lmc.lab.sim.knee import Setting, knee_sweeps
from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.workload.presets import preset_workload

POLICIES = ("load_balance", "bailian", "lmetric", "smetric")
VARIANT = "smetric_ect"


def _period(args: argparse.Namespace) -> float | str:
    return "inf" if math.isinf(args.period_s) else args.period_s  # JSON has no infinity


def learn(args: argparse.Namespace, base: SimConfig) -> dict[str, object]:
    """Per instance: its speed factor, its own learned prefill price and its decision price (÷ true);
    then the variant with unshrunk decision prices ÷ the default, per development seed."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from prices import _cfg as prices_cfg  # bench/prices.py part 1's cluster
    from prices import _workload, true_prefill_us

    prof = load_profile("qwen3-30b-a3b-h20")
    cfg = msgspec.structs.replace(prices_cfg(4, 0.8, 0.15, 3000.0), slowdown_cv=args.cv,
                                  slowdown_period_s=args.period_s)
    sim = Simulator(_workload(prof, 400), cfg, PolicyConfig(name=VARIANT), prof)
    sim.run()
    assert sim.price_feed is not None
    book = sim.price_feed.book
    ctx = int(st.median(int(v) for v in sim.rec.columns()["input"]))
    true = true_prefill_us(prof, ctx)
    rows = []
    for inst in sim.instances:
        f = inst.slowdown.factor(0.0) if math.isinf(args.period_s) else float("nan")
        own = book.prices(inst.iid).prefill_token_us(ctx) / true
        dec = book.decision_prices(inst.iid).prefill_token_us(ctx) / true
        rows.append({"instance": inst.iid, "factor": round(f, 4), "own": round(own, 4), "decision": round(dec, 4)})
        print(f"{inst.iid}: speed factor {f:.3f}  own learned prefill price ÷ true {own:.3f}  its decision price {dec:.3f}")
    fs, owns = np.array([r["factor"] for r in rows]), np.array([r["own"] for r in rows])
    corr = float(np.corrcoef(fs, owns)[0, 1]) if fs.std() > 0 else float("nan")
    err = float(np.mean(np.abs(owns / fs - 1)))
    print(f"{sim.price_feed.stats['observed']} done reports, context {ctx}: own prices vs factors r = {corr:.3f}, "
          f"mean |own / factor - 1| {100 * err:.1f}%")
    # (2) the variant deciding on each instance's own prices, against the default shrinkage
    size = paper.QUICK
    limit = int(0.9 * prof.max_context(64))
    seeds = [int(x) for x in args.seeds.split(",")]
    wls = {f"seed{s}": preset_workload("trace1", size.roots, seed=s, context_limit=limit) for s in seeds}
    sett = {s: Setting(f"seed{s}", paper._cfg(base, size, "full", s, fetch_gbs=1.6), prof) for s in seeds}
    pols = [PolicyConfig(name=VARIANT), PolicyConfig(name=VARIANT, params={"shrink_z": 0.0})]
    out = knee_sweeps(wls, sett, pols, PolicyConfig(name="smetric"), size.factors, args.jobs, size.pilots,
                      desc="slowdown: shrink", extend=size.extend, labels=["shrunk", "own"])
    ratio = {str(s): round(out[s].score("own") / out[s].score("shrunk"), 4) for s in seeds}
    vals = list(ratio.values())
    print(f"own prices ÷ shrunk, per seed: {ratio}; mean {st.mean(vals):.3f} sd {st.stdev(vals) if len(vals) > 1 else 0:.3f}")
    return {"cv": args.cv, "period_s": _period(args), "instances": rows, "corr_own": round(corr, 4),
            "own_rel_err": round(err, 4), "own_vs_shrunk": ratio}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cv", type=float, default=0.08, help="coefficient of variation of the step-time factor")
    ap.add_argument("--period-s", type=float, default=math.inf, help="how often it is redrawn (inf: fixed)")
    ap.add_argument("--settings", default="full", help=f"comma list of {', '.join((*paper.TIERS, paper.PD_KEY))}")
    ap.add_argument("--lmetric-offset", type=float, default=0.0, help="LMetric's load offset (0: the paper's)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--learn", action="store_true", help="what the learning variant makes of the spread")
    ap.add_argument("--seeds", default="1,2,5,6,7,8", help="--learn's development seeds")
    args = ap.parse_args(argv)
    if args.learn and not math.isinf(args.period_s):
        ap.error("--learn compares each instance's learned price with its fixed factor: --period-s inf")
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
    if args.learn:
        print(json.dumps(learn(args, base)))
        return 0
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
    print(json.dumps({"cv": args.cv, "period_s": _period(args), "lmetric_offset": args.lmetric_offset,
                      "wall_s": round(time.perf_counter() - t0), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
