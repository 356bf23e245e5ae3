"""Memory per in-flight request: what the load tracker and the index's pending prompts keep.

    python bench/controller.py --probe inflight_bytes [--n 100000]

Python heap bytes (tracemalloc) per entry for: a request in flight in ``LoadTracker`` (its
request id string included), a route already reported done within ``expire_s`` (its age cohort
lets go of it on done, so this should be ~0: an age queue of every route kept ~119 B each for
``expire_s``), and a distinct routed prompt pending in the index (``Pending``, 16 blocks).

Then what stays resident once ``--n`` in-flight requests have all expired (fresh processes, RSS
after a ``malloc_trim``): ``retained_mb`` plain, and ``retained_survivors_mb`` when one small
object in every 5,000 routes outlives the burst (as a counter's or a metric's latest value
does in the controller). pymalloc frees an arena (1 MiB) only when every block in it is free,
so a few dozen such survivors keep the burst's arenas resident: this is what is left of
``rss_growth_mb`` in ``bench/soak.py`` (its ``heap_mb`` shows the arenas against the blocks in
use). Under ``PYTHONMALLOC=malloc`` a survivor pins a 4 KiB page instead (printed too). Ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
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


_RETAINED = """
import sys
from smetric_lmc.controller.memory import malloc_trim, tune_malloc
from smetric_lmc.load import LoadTracker
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
tune_malloc()
n, survivors = int(sys.argv[1]), sys.argv[2] == "1"
t = [0.0]
lt = LoadTracker(lambda: t[0], expire_s=30.0)
malloc_trim()
base = rss()
kept = []
for k in range(n):
    garbage = list(range(1000 + k % 5000, 1256 + k % 5000))  # a decoded route's token ids
    lt.on_route(f"s{k}", f"i{k % 16}", 256)
    if survivors and k % 5000 == 0:
        kept.append(float(k))
    t[0] += 1e-4
t[0] += 100.0
while lt.expire():
    pass
malloc_trim()
print(rss() - base)
"""


def retained_mb(n: int, survivors: bool, pymalloc: bool = True) -> float:
    """RSS left in a fresh process after ``n`` in-flight requests expired (see the docstring)."""
    env = dict(os.environ)
    env.pop("PYTHONMALLOC", None)
    if not pymalloc:
        env["PYTHONMALLOC"] = "malloc"
    out = subprocess.run([sys.executable, "-c", _RETAINED, str(n), "1" if survivors else "0"],
                         capture_output=True, text=True, check=True, env=env)
    return round(float(out.stdout.strip()), 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100_000)
    n = p.parse_args(argv).n
    rng = random.Random(1)
    chains = [[rng.getrandbits(64) for _ in range(16)] for _ in range(n)]

    def in_flight() -> LoadTracker:
        lt = LoadTracker(lambda: 0.0, expire_s=30.0)
        for k in range(n):
            lt.on_route(f"s{k}", "a", 256)
        return lt

    def done() -> LoadTracker:
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

    out = {"in_flight_bytes": per_entry(in_flight, n), "done_bytes": per_entry(done, n),
           "pending_prompt_bytes": per_entry(pending, n),
           "retained_mb": retained_mb(n, False), "retained_survivors_mb": retained_mb(n, True),
           "retained_survivors_malloc_mb": retained_mb(n, True, pymalloc=False)}
    for k, v in out.items():
        print(f"{k}: {v} {'MB' if k.startswith('retained') else 'B per entry'}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
