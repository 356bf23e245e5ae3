"""LoadTracker work per engine /metrics poll with many requests in flight (lost done reports).

    python bench/load_scans.py                       # 400,000 in flight over 8 instances
    python bench/load_scans.py --in-flight 100000

Each poll calls ``reconcile`` per instance on the event loop. Times: the first poll after the
grace period (it heals or infers prefill for many entries: work proportional to what changes),
a steady-state poll (nothing left to change: should cost nearly nothing), and
``remove_instance`` (an instance leaving routing drops its entries). Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from smetric_lmc.load import LoadTracker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--in-flight", type=int, default=400_000)
    p.add_argument("--instances", type=int, default=8)
    args = p.parse_args()
    now = [0.0]
    lt = LoadTracker(clock=lambda: now[0], expire_s=30.0)
    for k in range(args.in_flight):
        now[0] = k * 1e-5
        lt.on_route(f"r{k}", f"i{k % args.instances}", 100)
    now[0] = 35.0
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    lt.reconcile("i0", 0, grace_s=30.0, engine_waiting=10, prefill_grace_s=1.0)
    out["first_poll_heals_ms"] = (time.perf_counter() - t0) * 1000
    lt.reconcile("i1", args.in_flight, grace_s=30.0, engine_waiting=10, prefill_grace_s=1.0)
    t0 = time.perf_counter()
    lt.reconcile("i1", args.in_flight, grace_s=30.0, engine_waiting=10, prefill_grace_s=1.0)
    out["steady_poll_ms"] = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    lt.remove_instance("i2")
    out["remove_instance_ms"] = (time.perf_counter() - t0) * 1000
    print(json.dumps({"in_flight": args.in_flight, "instances": args.instances,
                      **{k: round(v, 2) for k, v in out.items()}}))


if __name__ == "__main__":
    main()
