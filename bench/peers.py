"""Side by side with the peers' indexers: our TierIndex, NVIDIA Dynamo's RadixTree, LMCache 0.5.6.

    python bench/peers.py                       # 64 instances / 1 M blocks and 1,024 / 10 M
    python bench/peers.py --sizes 64x1000000    # one size
    python bench/peers.py --quick               # 8 instances / 20 k blocks (a smoke run)

The same cluster is built in each index: every instance holds a shared 2k-token system prompt plus
its own sessions (16-token blocks, as bench/decide.py), and the same queries are replayed: 32k-token
prompts (2,048 blocks), three follow-ups of stored sessions for every new session.

* ours — ``TierIndex`` GPU tier, stored as the live path stores vLLM events (our chain hash plus
  the engine's hash per block); a query is ``lookup(chain)``.
* Dynamo — ``dynamo._core.RadixTree`` (``pip install ai-dynamo-runtime``, the ``peers`` extra):
  ``apply_event(worker, json)`` with each block's engine hash and tokens hash; a query is
  ``find_matches(tokens hashes).scores``, what a Python router calls.
* LMCache — its controller's ``RegistryTree`` + ``KVController.lookup`` run in the LMCache venv
  (bench/kit/lmcache_venv.py finds it) on the same sessions at 256-token chunks, against our
  LMCache-tier lookup on the same chunks.

Each peer builds in its own fresh process, so index memory is that process's RSS delta after
``gc.collect()``, divided by the blocks (chunks for LMCache) indexed. Agreement: the best hit of
each query (the longest prefix any instance holds) must be equal across peers. Lookup timings are
per query, in microseconds, side by side in one run (absolute figures drift with machine load).

Ends with ONE JSON line: ``{"vs_dynamo_speed_64", "vs_dynamo_speed_1024", "bytes_per_block_64",
"bytes_per_block_1024", "dynamo_bytes_per_block_1024", "vs_lmcache_speed", "agree"}`` (speed =
peer p50 / our p50; vs_lmcache_speed is the smallest over the sizes run; null where not run).
Targets: >= 5x Dynamo at both sizes, our bytes per block <= Dynamo's at 1,024 instances,
agreement 1.0, >= 10x LMCache.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kit.peers import PROMPT_BLOCKS, Size, compare


def report(size: Size, got: dict[str, Any]) -> None:
    print(f"== {size.instances} instances, {got['ours'].blocks:,} blocks, {size.queries} queries of "
          f"{PROMPT_BLOCKS} blocks")
    for key in ("ours", "dynamo", "lmcache", "ours_lmcache"):
        r = got.get(key)
        if r is None:
            continue
        mem = "" if r.bytes_per_block is None else f", {r.bytes_per_block:.0f} bytes per entry"
        print(f"  {r.peer:18s} lookup p50 {r.pct(50):8.1f} us, p99 {r.pct(99):8.1f} us; "
              f"built in {r.build_s:.1f} s ({r.blocks:,} entries){mem}")
    for key, label in (("dynamo", "Dynamo"), ("lmcache", "LMCache")):
        if key in got:
            base = got["ours"] if key == "dynamo" else got["ours_lmcache"]
            print(f"  vs {label}: {got[key].pct(50) / base.pct(50):.1f}x faster (p50)")
    print(f"  agreement of the best hit per query: {got['agree']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64x1000000,1024x10000000", help="INSTANCESxBLOCKS, comma separated")
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--peers", default="dynamo,lmcache")
    ap.add_argument("--quick", action="store_true", help="8 instances / 20 k blocks, 300 queries")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.queries = "8x20000", 300
    peers = [p for p in args.peers.split(",") if p]
    summary: dict[str, Any] = {"vs_dynamo_speed_64": None, "vs_dynamo_speed_1024": None, "bytes_per_block_64": None,
                               "bytes_per_block_1024": None, "dynamo_bytes_per_block_1024": None,
                               "vs_lmcache_speed": None, "agree": None}
    agree: list[float] = []
    lmc: list[float] = []
    for spec in args.sizes.split(","):
        n, blocks = (int(x) for x in spec.lower().split("x"))
        size = Size(n, blocks, args.queries)
        got = compare(size, peers)
        report(size, got)
        agree += got["agree"].values()
        tag = str(n)
        summary[f"bytes_per_block_{tag}"] = round(got["ours"].bytes_per_block, 1)
        if "dynamo" in got:
            summary[f"vs_dynamo_speed_{tag}"] = round(got["dynamo"].pct(50) / got["ours"].pct(50), 2)
            summary[f"dynamo_bytes_per_block_{tag}"] = round(got["dynamo"].bytes_per_block, 1)
        if "lmcache" in got:
            lmc.append(got["lmcache"].pct(50) / got["ours_lmcache"].pct(50))
    summary["vs_lmcache_speed"] = round(min(lmc), 2) if lmc else None
    summary["agree"] = round(min(agree), 4) if agree else None
    keep = ["vs_dynamo_speed_64", "vs_dynamo_speed_1024", "bytes_per_block_64", "bytes_per_block_1024",
            "dynamo_bytes_per_block_1024", "vs_lmcache_speed", "agree"]
    print(json.dumps({k: summary.get(k) for k in keep}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
