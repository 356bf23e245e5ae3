"""LoadTracker work per engine /metrics poll with many requests in flight (lost done reports).

    python bench/controller.py --probe load_scans                       # 400,000 in flight over 8 instances
    python bench/controller.py --probe load_scans --in-flight 100000

Each poll calls ``reconcile`` per instance on the event loop, in slices of ``RECONCILE_SLICE``
entries (the poller yields to the loop between them: controller/engine_metrics.py). Times: the
longest slice of the first poll after the grace period (it heals or infers prefill for many
entries), that poll's slices and total, a steady-state poll (nothing left to change: should cost
nearly nothing), and ``remove_instance`` (an instance leaving routing: its entries are forgotten
by ``drain`` slices) with its longest drain slice. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from smetric_lmc.controller.engine_metrics import RECONCILE_SLICE
from smetric_lmc.load import LoadTracker


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--in-flight", type=int, default=400_000)
    p.add_argument("--instances", type=int, default=8)
    args = p.parse_args(argv)
    now = [0.0]
    lt = LoadTracker(clock=lambda: now[0], expire_s=30.0)
    for k in range(args.in_flight):
        now[0] = k * 1e-5
        lt.on_route(f"r{k}", f"i{k % args.instances}", 100)
    now[0] = 35.0
    out: dict[str, float] = {}

    def poll(iid: str, count: int) -> tuple[float, int, float]:
        worst, slices, t_all = 0.0, 0, time.perf_counter()
        while True:
            t0 = time.perf_counter()
            lt.reconcile(iid, count, grace_s=30.0, engine_waiting=10, prefill_grace_s=1.0, budget=RECONCILE_SLICE)
            worst = max(worst, time.perf_counter() - t0)
            slices += 1
            if not lt.reconcile_left:
                return worst * 1000, slices, (time.perf_counter() - t_all) * 1000

    out["first_poll_heals_ms"], first_slices, out["first_poll_total_ms"] = poll("i0", 0)
    poll("i1", args.in_flight)
    out["steady_poll_ms"], _, _ = poll("i1", args.in_flight)
    t0 = time.perf_counter()
    lt.remove_instance("i2")
    out["remove_instance_ms"] = (time.perf_counter() - t0) * 1000
    worst = 0.0
    while True:
        t0 = time.perf_counter()
        left = lt.drain()
        worst = max(worst, time.perf_counter() - t0)
        if not left:
            break
    out["drain_slice_ms"] = worst * 1000
    healed = lt.stats["healed"]
    print(json.dumps({"in_flight": args.in_flight, "instances": args.instances, "first_poll_slices": first_slices,
                      "healed": healed, "in_flight_after": len(lt), **{k: round(v, 2) for k, v in out.items()}}))


if __name__ == "__main__":
    main()
