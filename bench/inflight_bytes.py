"""Memory per in-flight request: what the load tracker and the index's pending prompts keep.

    python bench/inflight_bytes.py [--n 100000]

Python heap bytes (tracemalloc) per entry for: a request in flight in ``LoadTracker`` (its
request id string included), a route already reported done whose age-queue record waits for
``expire_s``, and a distinct routed prompt pending in the index (``Pending``, 16 blocks). Ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tracemalloc
from collections.abc import Callable
from typing import Any

from smetric_lmc.index.side import Pending
from smetric_lmc.load import LoadTracker


def per_entry(build: Callable[[], Any], n: int) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = build()  # noqa: F841  (held until measured)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return round((after - before) / n, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100_000)
    n = p.parse_args().n
    rng = random.Random(1)
    chains = [[rng.getrandbits(64) for _ in range(16)] for _ in range(n)]

    def in_flight() -> LoadTracker:
        lt = LoadTracker(lambda: 0.0, expire_s=30.0)
        for k in range(n):
            lt.on_route(f"s{k}", "a", 256)
        return lt

    def done_queued() -> LoadTracker:
        lt = LoadTracker(lambda: 0.0, expire_s=30.0)
        for k in range(n):
            lt.on_route(f"s{k}", "a", 256)
            lt.on_done(f"s{k}")
        return lt

    def pending() -> Pending:
        pd = Pending(30.0)
        for c in chains:
            pd.add(0, c, 0.0)
        return pd

    out = {"in_flight_bytes": per_entry(in_flight, n), "done_queued_bytes": per_entry(done_queued, n),
           "pending_prompt_bytes": per_entry(pending, n)}
    for k, v in out.items():
        print(f"{k}: {v} B per entry")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
