"""The simulator: its speed on a full trace, or selected regime-map cells over several seeds.

    python bench/sim.py [--policy smetric] [--instances 32] [--sessions N]
    python bench/sim.py --map-cells none@0.3,0.4@0.3,full@0.3 --seeds 0,1,2 --jobs 1
    python bench/sim.py --map-cells none@0.05 --seeds 5,6 --set queue_no_global=0   # a held-out pair

Default mode, simulator speed: a full WEKA Claude Code replay for one policy on 32 instances. Reads
the archive from $SMETRIC_SHARED/traces/weka-claude-code.tar.xz (default: <repo>/../shared). Prints
human-readable numbers, then ONE JSON object on its last line:
{"sim_weka_s": <simulation seconds>, "sim_peak_mb": <peak resident memory of the process, MB>, ...}

``--map-cells``: every policy's score ÷ the best baseline's in the cells named (tier@x), mean ±
standard deviation of the paired per-seed ratios (the same arrivals for every policy). Each cell runs
as the full report's map does (`smetric sim report`: instances, window, loads per knee, bracketing,
sessions per cell), unless an option says otherwise; ``--set`` changes one of the variant's YAML
parameters. Prints one line per cell, then ONE JSON line: {"<tier>@<x>": {"<policy>": [mean, sd]}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import statistics as st
import sys
import time
from pathlib import Path

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.cluster import simulate
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.sim.regime_map import BASELINES, run_map
from smetric_lmc.lab.sim.results_doc import FULL
from smetric_lmc.lab.workload import load_weka


def shared_dir() -> Path:
    return Path(os.environ.get("SMETRIC_SHARED", Path(__file__).resolve().parents[1] / ".." / "shared"))


def _value(v: str) -> float | str:
    try:
        return float(v)
    except ValueError:
        return v


def map_cells(a: argparse.Namespace) -> int:
    """Selected regime-map cells over several arrival seeds (``--map-cells``)."""
    try:
        cells = [(t, float(x)) for t, x in (c.split("@") for c in a.map_cells.split(","))]
        kw = {k: _value(v) for k, v in (s.split("=", 1) for s in a.set)}
        seeds = tuple(int(s) for s in a.seeds.split(","))
    except ValueError:
        print(f"--map-cells wants tier@x,... and --set KEY=VALUE, got {a.map_cells!r} {a.set}", file=sys.stderr)
        return 2
    extra = tuple(p for p in a.extra.split(",") if p)
    # the variant's parameters live under policy.params (smetric_ect: ECTParams)
    vpol = PolicyConfig(name=a.variant, params=kw) if a.variant else None  # type: ignore[arg-type]
    out: dict[str, dict[str, list[float]]] = {}
    for x in sorted({x for _, x in cells}):
        spec = dataclasses.replace(
            FULL.map, xs=(x,), tiers=tuple(t for t, xx in cells if xx == x), instances=a.instances or FULL.map.instances,
            window_s=a.window, min_sessions=a.min_sessions, variant=a.variant, variant_policy=vpol,
            baselines=BASELINES + extra, seeds=seeds,
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
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="smetric")
    ap.add_argument("--instances", type=int, help=f"32; --map-cells: {FULL.map.instances} (the report's map)")
    ap.add_argument("--rate", type=float, default=None, help="session arrivals/s (default: configs/sim.yaml)")
    ap.add_argument("--global", dest="global_tier", default="none")
    ap.add_argument("--pd", action="store_true")
    ap.add_argument("--sessions", type=int, help="replay only N root sessions")
    g = ap.add_argument_group("--map-cells")
    g.add_argument("--map-cells", metavar="CELLS", help="comma list of tier@x, e.g. none@0.3,full@0.05")
    g.add_argument("--seeds", default="0,1", help="comma list of arrival seeds")
    g.add_argument("--window", type=float, default=FULL.map.window_s)
    g.add_argument("--min-sessions", type=int, default=FULL.map.min_sessions,
                   help="stretch each cell's window to this many root sessions")  # fmt: skip
    g.add_argument("--variant", default=FULL.map.variant)
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a variant parameter (policy.params)")
    g.add_argument("--extra", default="", help="comma list of policies run beside (not baselines)")
    g.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args(argv)
    if args.map_cells:
        return map_cells(args)
    args.instances = args.instances or 32
    logging.basicConfig(level=logging.WARNING)
    archive = shared_dir() / "traces" / "weka-claude-code.tar.xz"
    if not archive.exists():
        print(f"trace not found: {archive} (set SMETRIC_SHARED)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    wl = load_weka(archive, progress=False)
    t_load = time.perf_counter() - t0
    cfg = load_sim_config(instances=args.instances, rate=args.rate, global_tier=args.global_tier, pd=args.pd,
                          max_sessions=args.sessions)
    t1 = time.perf_counter()
    c1 = time.process_time()
    res = simulate(wl, cfg, args.policy)
    t_sim = time.perf_counter() - t1
    c_sim = time.process_time() - c1
    # ru_maxrss is in KiB on Linux: the peak of the whole process (trace loading included)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    s = res.summary
    print(f"trace: {wl.n_requests} requests in {len(wl.sessions)} sessions, loaded in {t_load:.1f} s")
    print(f"policy {args.policy}, {args.instances} instances, rate {cfg.rate}/s, global {cfg.global_tier}, pd {cfg.pd}")
    print(f"simulated {s['duration_s']:.0f} s of cluster time in {t_sim:.1f} s wall, {c_sim:.1f} s CPU "
          f"({s['events']} events)")
    print(
        f"TPS within SLO {s['tps_slo']:.0f}  (all {s['tps']:.0f}), SLO attainment {s['slo_attainment']:.3f}, "
        f"hits local {s['hit_local']:.3f} global {s['hit_global']:.3f}, stickiness {s['stickiness']:.3f}, "
        f"imbalance {s['imbalance_mean']:.2f}, rejected {s['rejected']}"
    )
    print(f"peak resident memory {peak:.0f} MB")
    print(json.dumps({"sim_weka_s": round(t_sim, 2), "sim_weka_cpu_s": round(c_sim, 2), "sim_load_s": round(t_load, 2),
                      "sim_peak_mb": round(peak, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
