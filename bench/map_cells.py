"""Selected regime-map cells over several arrival seeds: every policy's score ÷ the best baseline's,
mean ± standard deviation of the paired per-seed ratios (the same arrivals for every policy).

    python bench/map_cells.py none@0.3,0.4@0.3,full@0.3 --seeds 0,1,2 --jobs 1
    python bench/map_cells.py none@0.05 --seeds 5,6 --set queue_no_global=0   # a held-out pair

Each cell runs as the full report's map does (`smetric sim report`: instances, window, loads per
knee, bracketing, sessions per cell), unless an option says otherwise; ``--set`` changes one of the
variant's YAML parameters. Prints one line per cell, then one JSON line with every cell's means and
spreads, against the best baseline and against SMetric.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics as st

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.sim.regime_map import BASELINES, run_map
from smetric_lmc.lab.sim.results_doc import FULL


def _value(v: str) -> float | str:
    try:
        return float(v)
    except ValueError:
        return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cells", help="comma list of tier@x, e.g. none@0.3,full@0.05")
    ap.add_argument("--seeds", default="0,1", help="comma list of arrival seeds")
    ap.add_argument("--instances", type=int, default=FULL.map.instances)
    ap.add_argument("--window", type=float, default=FULL.map.window_s)
    ap.add_argument("--min-sessions", type=int, default=FULL.map.min_sessions,
                    help="stretch each cell's window to this many root sessions")  # fmt: skip
    ap.add_argument("--variant", default=FULL.map.variant)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a variant parameter (policy.params)")
    ap.add_argument("--extra", default="", help="comma list of policies run beside (not baselines)")
    ap.add_argument("--jobs", type=int, default=1)
    a = ap.parse_args()
    cells = [(t, float(x)) for t, x in (c.split("@") for c in a.cells.split(","))]
    extra = tuple(p for p in a.extra.split(",") if p)
    kw = {k: _value(v) for k, v in (s.split("=", 1) for s in a.set)}
    # the variant's parameters live under policy.params (smetric_ect: ECTParams)
    vpol = PolicyConfig(name=a.variant, params=kw) if a.variant else None  # type: ignore[arg-type]
    out: dict[str, dict[str, list[float]]] = {}
    for x in sorted({x for _, x in cells}):
        spec = dataclasses.replace(
            FULL.map, xs=(x,), tiers=tuple(t for t, xx in cells if xx == x), instances=a.instances,
            window_s=a.window, min_sessions=a.min_sessions, variant=a.variant, variant_policy=vpol,
            baselines=BASELINES + extra, seeds=tuple(int(s) for s in a.seeds.split(",")),
        )  # fmt: skip
        m = run_map(spec, load_sim_config(None), load_profile("qwen3-30b-a3b-h20"), a.jobs)
        for c in m.cells:
            b, _ = c.best_baseline(BASELINES)
            row = {p: c.seed_ratios(p, b) for p in spec.policies}
            sd = {p: st.stdev(v) if len(v) > 1 else 0.0 for p, v in row.items()}
            vs = {p: st.mean(c.seed_ratios(p, spec.ours)) for p in spec.policies if p != spec.ours}
            print(f"{c.tier}@{c.x:.3f} best={b} "
                  + " ".join(f"{p}={st.mean(v):.3f}±{sd[p]:.2f}" for p, v in row.items())
                  + " | ÷smetric " + " ".join(f"{p}={v:.3f}" for p, v in vs.items()), flush=True)  # fmt: skip
            out[f"{c.tier}@{c.x:.3f}"] = {p: [round(st.mean(v), 4), round(sd[p], 4)] for p, v in row.items()}
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
