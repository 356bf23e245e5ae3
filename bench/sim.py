"""Simulator speed: a full WEKA Claude Code replay for one policy on 32 instances.

Reads the archive from $SMETRIC_SHARED/traces/weka-claude-code.tar.xz (default: <repo>/../shared).
Prints human-readable numbers, then ONE JSON object on its last line:
{"sim_weka_s": <simulation seconds>, "sim_peak_mb": <peak resident memory of the process, MB>, ...}
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

from smetric_lmc.lab.sim.cluster import simulate
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.workload import load_weka


def shared_dir() -> Path:
    return Path(os.environ.get("SMETRIC_SHARED", Path(__file__).resolve().parents[1] / ".." / "shared"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", default="smetric")
    ap.add_argument("--instances", type=int, default=32)
    ap.add_argument("--rate", type=float, default=None, help="session arrivals/s (default: configs/sim.yaml)")
    ap.add_argument("--global", dest="global_tier", default="none")
    ap.add_argument("--pd", action="store_true")
    ap.add_argument("--sessions", type=int, help="replay only N root sessions")
    args = ap.parse_args(argv)
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
