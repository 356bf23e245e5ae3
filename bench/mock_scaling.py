"""Mock engines: many instances in one asyncio process, or spread over several processes?

    python bench/mock_scaling.py [--instances 32] [--processes 1,2,4] [--seconds 10]

For each process count: bring up the mock stack (mock engines + controller + gateway), measure the
routed tiny requests per second through the gateway, the mock processes' resident memory, and the
start-up time. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from validate import probe_routes

from smetric_lmc.lab.mock_engine.stack import bring_up_mock  # noqa: E402
from smetric_lmc.lab.replay.compare import warm_up  # noqa: E402
from smetric_lmc.workers import launch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=32)
    ap.add_argument("--processes", default="1,2,4")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    rows = []
    for procs in (int(x) for x in args.processes.split(",")):
        work = Path(tempfile.mkdtemp(prefix=f"smetric-mock-{procs}p-"))
        ns = argparse.Namespace(mock=args.instances, mock_processes=procs, host="127.0.0.1",
                                port=0, policy="smetric", mock_args="--speed 50")
        t0 = time.perf_counter()
        stack = bring_up_mock(ns, work)
        start_s = time.perf_counter() - t0
        try:
            import yaml

            warm_up(stack.gateway_url, yaml.safe_load(stack.config_path.read_text())["server"]["route_url"])
            rps = probe_routes(stack.gateway_url, args.seconds)
            rss = sum(launch.group_rss_bytes(p.pid) for p in stack.processes[:procs] if p.pid)
        finally:
            stack.stop()
        rows.append({"processes": procs, "routes_per_s": round(rps, 1), "mock_rss_mb": round(rss / 2**20, 1),
                     "start_s": round(start_s, 1)})
        print(f"{procs} process(es): {rps:.0f} routed requests/s, mock RSS {rss / 2**20:.0f} MB, "
              f"stack up in {start_s:.1f} s", flush=True)
    print(json.dumps({"instances": args.instances, "runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
