"""Selected regime-map cells over several arrival seeds: every policy's score ÷ the best baseline's,
mean ± standard deviation of the paired per-seed ratios (the same arrivals for every policy).

    python bench/map_cells.py none@0.3,0.4@0.3,full@0.3 --seeds 3 --instances 8 --window 600 --jobs 2

Prints one line per cell, then one JSON line with every cell's means and spreads.
"""

from __future__ import annotations

import argparse
import json
import statistics as st

from smetric_lmc.sim.config import load_sim_config
from smetric_lmc.sim.profile import load_profile
from smetric_lmc.sim.regime_map import BASELINES, MapSpec, run_map


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cells", help="comma list of tier@x, e.g. none@0.3,full@0.05")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--window", type=float, default=600.0)
    ap.add_argument("--variant", default="smetric_ect")
    ap.add_argument("--extra", default="smetric_cost", help="comma list of policies run beside (not baselines)")
    ap.add_argument("--min-sessions", type=int, default=0, help="stretch each cell's window to this many root sessions")
    ap.add_argument("--warmup", type=float, default=0.4, help="share of the window left out of the measurement")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    cells = [(t, float(x)) for t, x in (c.split("@") for c in a.cells.split(","))]
    extra = tuple(p for p in a.extra.split(",") if p)
    out: dict[str, dict[str, list[float]]] = {}
    for x in sorted({x for _, x in cells}):
        spec = MapSpec(xs=(x,), tiers=tuple(t for t, xx in cells if xx == x), instances=a.instances,
                       pool_roots=200, window_s=a.window, rate_factors=(1.0, 1.5), pilots=2, variant=a.variant,
                       baselines=BASELINES + extra, seeds=tuple(range(a.seeds)), min_sessions=a.min_sessions,
                       warmup_share=a.warmup)  # fmt: skip
        m = run_map(spec, load_sim_config(None), load_profile("qwen3-30b-a3b-h20"), a.jobs)
        for c in m.cells:
            b, _ = c.best_baseline(BASELINES)
            row = {p: c.seed_ratios(p, b) for p in spec.policies}
            sd = {p: st.stdev(v) if len(v) > 1 else 0.0 for p, v in row.items()}
            print(f"{c.tier}@{c.x:.3f} best={b} "
                  + " ".join(f"{p}={st.mean(v):.3f}±{sd[p]:.2f}" for p, v in row.items()), flush=True)  # fmt: skip
            out[f"{c.tier}@{c.x:.3f}"] = {p: [round(st.mean(v), 4), round(sd[p], 4)] for p, v in row.items()}
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
