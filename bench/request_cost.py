"""The controller's CPU per request, by policy and cluster size: one route and its done report.

What the controller runs per request, in-process: ``RouteCore.handle`` of the encoded route
request (lookup, policy, load accounting, the price feed's record) and of its done report (load
release, the price estimator's update: every policy's controller learns prices for ``stats`` and
Prometheus; ``smetric_ect`` also decides with them, pricing every candidate). The wire codec is
included, the ZMQ transport is not (``bench/controller.py`` times that). A 64-token prompt, so
the index's share stays small and what grows with the cluster shows: the variant's per-candidate
pricing. TTFTs vary by ±50% so the fits keep learning (every done report moves the cluster's fit,
which is when decisions are re-priced).

    python bench/request_cost.py
    python bench/request_cost.py --policies smetric_ect --instances 8,32 --requests 5000

Prints a table (thread CPU µs per request, median over ``--repeats`` passes), then ONE JSON line:
``{"route_us": {"<policy>@<n>": x}, "done_us": {...}, "requests": N, "load_average": x}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kit.route_core import make_core  # noqa: E402
from smetric_lmc.config import PolicyConfig  # noqa: E402
from smetric_lmc.controller.prices import make_feed  # noqa: E402
from smetric_lmc.wire import DoneReport, RouteRequest, encode  # noqa: E402

WARMUP = 500  # requests before timing: the fits leave their priors, every instance has served


def one_pass(policy: str, instances: int, requests: int, seed: int) -> tuple[float, float]:
    """(route, done) thread-CPU µs per request over ``requests`` timed requests."""
    core = make_core(instances)
    cfg = PolicyConfig(name=policy)
    core.router.set_policy(cfg)
    core.router.prices = core.fallback.prices = make_feed(cfg)
    core._ready = True  # route with the policy from the first request (no engine fills the index here)
    rng = random.Random(seed)
    route_ns = done_ns = 0
    for k in range(WARMUP + requests):
        start = k % 50  # 50 distinct prompts: some repeat on the instance that served them
        route = encode(RouteRequest(request_id=f"r{k}", token_ids=list(range(start, start + 64))))
        done = encode(DoneReport(request_id=f"r{k}", prompt_tokens=64, output_tokens=8,
                                 ttft_s=0.05 * (0.5 + rng.random()), e2e_s=0.3))
        t0 = time.thread_time_ns()
        core.handle(route)
        t1 = time.thread_time_ns()
        core.handle(done)
        t2 = time.thread_time_ns()
        if k >= WARMUP:
            route_ns += t1 - t0
            done_ns += t2 - t1
    return route_ns / requests / 1e3, done_ns / requests / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="smetric,smetric_ect,load_balance")
    ap.add_argument("--instances", default="8,16,32", help="comma-separated cluster sizes")
    ap.add_argument("--requests", type=int, default=3000, help="timed requests per pass")
    ap.add_argument("--repeats", type=int, default=3, help="passes per cell (the median is reported)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.instances.split(",") if x.strip()]
    except ValueError:
        print(f"request_cost: --instances takes comma-separated counts, got {args.instances!r}", file=sys.stderr)
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not sizes or min(sizes) < 1 or not policies or args.requests < 1 or args.repeats < 1:
        print("request_cost: need at least one policy, sizes >= 1, --requests and --repeats >= 1", file=sys.stderr)
        return 2
    cells = [(p, n) for p in policies for n in sizes]
    route: dict[str, float] = {}
    done: dict[str, float] = {}
    print(f"{'policy':14s} {'instances':>9s} {'route µs':>9s} {'done µs':>8s}")
    for k, (policy, n) in enumerate(cells, 1):
        try:
            runs = [one_pass(policy, n, args.requests, args.seed + r) for r in range(args.repeats)]
        except ValueError as exc:  # an unknown policy name
            print(f"request_cost: {exc}", file=sys.stderr)
            return 2
        key = f"{policy}@{n}"
        route[key] = round(statistics.median(r for r, _ in runs), 1)
        done[key] = round(statistics.median(d for _, d in runs), 1)
        print(f"{policy:14s} {n:9d} {route[key]:9.1f} {done[key]:8.1f}   [{k}/{len(cells)}]", flush=True)
    print(json.dumps({"route_us": route, "done_us": done, "requests": args.requests,
                      "load_average": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
