"""What a full cyclic-GC collection walks in a busy controller's long-lived state, and its time.

    python bench/controller.py --probe gc_pauses                      # 120,000 routed prompts pending, as many in flight
    python bench/controller.py --probe gc_pauses --prompts 30000

A controller routing thousands of prompts a second keeps, for ``pending_ttl_s`` (30 s), one
pending entry per routed prompt in the index (``index/side.py`` ``Pending``) and one in-flight
entry per request until its done (``LoadTracker``). The cyclic GC's full collections stop the
event loop for time proportional to the objects it tracks, so this state is kept out of its
reach (dicts of ints, gc=False structs); the containers holding it exist from start-up, which the
controller freezes out of the GC (``gc.freeze()``, as ``--freeze`` does here before the fill), so
a collection does not even walk their entries. Prints the objects tracked beyond a bare process
and the worst of 3 full collections (wall and CPU), then ONE JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=120_000)
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--freeze", action="store_true", help="gc.freeze() after building, as the controller's start")
    args = p.parse_args(argv)
    gc.collect()
    base = len(gc.get_objects())
    ix = TierIndex(16, 256)
    load = LoadTracker(expire_s=30.0)
    ids = [f"i{k}" for k in range(args.instances)]
    for iid in ids:
        ix.register_instance(iid)
    if args.freeze:
        gc.freeze()
        base = len(gc.get_objects())
    rng = random.Random(1)
    for k in range(args.prompts):
        chain = [rng.getrandbits(63) for _ in range(rng.randrange(2, 200))]
        ix.add_pending(ids[k % len(ids)], chain)
        load.on_route(f"r{k}", ids[k % len(ids)], 16 * len(chain))
    gc.collect()
    tracked = len(gc.get_objects()) - base
    worst = worst_cpu = 0.0
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.thread_time()
        gc.collect()
        worst = max(worst, time.perf_counter() - t0)
        worst_cpu = max(worst_cpu, time.thread_time() - c0)
    print(f"{args.prompts} pending prompts and requests in flight: {tracked} objects tracked by the GC, "
          f"full collection {worst * 1000:.1f} ms ({worst_cpu * 1000:.1f} ms CPU)")
    print(json.dumps({"prompts": args.prompts, "frozen_at_start": args.freeze, "gc_tracked": tracked, "full_collection_ms": round(worst * 1000, 1),
                      "full_collection_cpu_ms": round(worst_cpu * 1000, 1)}))


if __name__ == "__main__":
    main()
