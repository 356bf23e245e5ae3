"""How far to trust the simulator: real engines vs simulator, and the live stack vs simulator.

    python bench/validate.py [--skip-real] [--mock-instances 32] [--sessions 32]

1. Real (``smetric sim validate``): 2 vLLM CPU engines + controller + gateway, calibrated, one small
   workload replayed per policy, then simulated with the calibrated profile (skipped with
   ``--skip-real`` or when the engine venv is missing; its JSON fields are then null).
2. Mock live vs simulated: the same workload on ``--mock-instances`` mock engines through the real
   controller and gateway, and in the simulator with the same profile: local-hit ratio and
   route-reason mix per policy.
3. Routes per second the mock stack sustains (tiny requests through gateway + controller).

Prints tables, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from smetric_lmc.lab.replay.compare import compare, comparison_table, reasons_side_by_side, with_kv_tokens
from smetric_lmc.lab.replay.prompts import scale_workload
from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.workload import synthetic


def probe_routes(gateway_url: str, seconds: float = 10.0, concurrency: int = 64) -> float:
    """Completed tiny requests per second through the gateway (each one route + done)."""

    async def run() -> float:
        done = 0
        stop = time.monotonic() + seconds
        async with aiohttp.ClientSession() as http:

            async def worker(w: int) -> None:
                nonlocal done
                k = 0
                while time.monotonic() < stop:
                    k += 1
                    prompt = [100 + (w * 7919 + k * 104729 + j) % 3000 for j in range(80)]
                    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
                    async with http.post(f"{gateway_url}/v1/completions", json=body) as r:
                        await r.read()
                        done += r.status == 200

            t0 = time.monotonic()
            await asyncio.gather(*(worker(w) for w in range(concurrency)))
            return done / (time.monotonic() - t0)

    return asyncio.run(run())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-real", action="store_true", help="skip the real-engine validation")
    ap.add_argument("--mock-instances", type=int, default=32)
    ap.add_argument("--sessions", type=int, default=32, help="synthetic sessions for the mock comparison")
    ap.add_argument("--context-scale", type=float, default=0.1)
    ap.add_argument("--kv-tokens", type=int, default=32000, help="KV cache per mock instance (tokens)")
    ap.add_argument("--rate", type=float, default=0.08, help="sessions per model second")
    ap.add_argument("--speed", type=float, default=50.0, help="model seconds per wall second")
    ap.add_argument("--max-think-s", type=float, default=60.0)
    ap.add_argument("--policies", default="smetric,load_balance")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--repeats", type=int, default=3,
                    help="real engines: replays of each policy, in a balanced order (ABC CBA ABC ...)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="smetric-validate-"))
    out: dict[str, Any] = {"engines": None, "policies": None, "hit_abs_err_max": None, "tput_rel_err_max": None,
                           "ttft_p50_rel_err_max": None, "rank_agree": None, "rank_noise_rel": None,
                           "rank_pairs_separated": None, "rank_ties": None}
    if not args.skip_real:
        from smetric_lmc.lab.replay.validate import real_available, validate_real

        why = real_available()
        if why:
            print(f"real-engine validation skipped: {why}")
        else:
            out.update(validate_real(work / "real", repeats=args.repeats))
    wl = scale_workload(synthetic(args.sessions, seed=0), args.context_scale)
    prof = with_kv_tokens(load_profile(), args.kv_tokens)
    pols = args.policies.split(",")
    routes: list[float] = []
    print(f"mock live vs sim: {args.mock_instances} mock engines, {wl.n_requests} requests, {prof.name}, "
          f"speed {args.speed:g}")
    t0 = time.perf_counter()
    rows = compare(wl, prof, pols, instances=args.mock_instances, rate=args.rate, speed=args.speed,
                   max_think_s=args.max_think_s, workdir=work / "mock",
                   after=lambda stack: routes.append(probe_routes(stack.gateway_url)))
    print(comparison_table(rows))
    print(reasons_side_by_side(rows))
    print(f"mock stack: {routes[0]:.0f} routed requests/s ({time.perf_counter() - t0:.0f} s for this part)")
    out.update(
        mock_instances=args.mock_instances,
        mock_live_vs_sim_hit_abs_err_max=round(max(c.hit_abs_err for c in rows), 4),
        mock_live_vs_sim_reason_abs_err_max=round(max(c.reason_abs_err for c in rows), 4),
        mock_routes_per_s=round(routes[0], 1),
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
