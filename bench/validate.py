"""How far to trust the simulator: real engines vs simulator, and the live stack vs simulator.

    python bench/validate.py [--skip-real] [--mock-instances 32] [--sessions 32]
    python bench/validate.py --ablation WORKDIR/real   # the folder `smetric sim validate --out` wrote
    python bench/validate.py --mock-scaling [--mock-instances 32] [--processes 1,2,4] [--seconds 10]

Default mode:
1. Real (``smetric sim validate``): 2 vLLM CPU engines + controller + gateway, calibrated, one small
   workload replayed per policy, then simulated with the calibrated profile (skipped with
   ``--skip-real`` or when the engine venv is missing; its JSON fields are then null).
2. Mock live vs simulated: the same workload on ``--mock-instances`` mock engines through the real
   controller and gateway, and in the simulator with the same profile: local-hit ratio and
   route-reason mix per policy.
3. Routes per second the mock stack sustains (tiny requests through gateway + controller).
Prints tables, then ONE JSON line.

``--ablation WORKDIR``: what each part of the real-engine model contributes, recomputed from a
validation's outputs (tables only, no JSON line). For every replay (policy and repeat), the live
records against simulations of the same workload:
  idle          the idle-engine profile, no request path (the validation before this model)
  + idle path   the idle profile, the request path measured with tiny requests one at a time
  + slowdown    the profile slowed as the calibration replays around the replay measured, the idle path
  before only, const    slowdown and a constant request path under load from the calibration replay
                just before the replay alone (refitted from its records; the validation before this
                round)
  before only   the same, the path growing with the requests in flight on the serving engine
  fitted const  slowdown and a constant path from the calibration replays before and after
  fitted        the same, the path growing with the requests in flight on the serving engine (what
                `smetric sim validate` reports)
  fitted, KV unbounded   the same with a KV cache no request evicts from: what the engines' small
                KV capacity (``--num-gpu-blocks-override``) adds to the policies' differences
  common profile         the first replay's fitted profile and path for every replay: the policies'
                differences without the load drifting between their calibration replays
  measured steal   the calibrations' slowdown per engine, scaled by the engine's run share during the
                replay over its run share during the calibrations (``replay.schedstat``: the worker's
                run / (run + run-queue wait), from the kernel, not from the replay's outcome)
  measured steal, all threads   the same with every thread of the engine counted: what
                `smetric sim validate` reports as ``tput_sim`` (``validate.SPEED_SIGNAL``; runs that
                recorded one share only recorded this one)
  oracle speed  NOT a prediction: slowdown and path fitted on this replay itself (its decode time per
                token and TTFT p50, so its TTFT error is ~0 by construction); what throughput and
                local hit the model gives when it knows how fast the engines ran during the replay

Then the TTFT per request: live against simulated (constant path and load-dependent path), by how many
other requests were in flight on the serving engine when the request arrived (live count for the
live column, simulated count for the simulated ones). Last, each model's mean and largest |error|
over the replays, and the simulated local hit and throughput of each policy as the engines slow
down (the idle profile, 2x to 12x slower; the request path of the first replay).

``--mock-scaling``: mock engines, many instances in one asyncio process or spread over several? For
each ``--processes`` count: bring up the mock stack (``--mock-instances`` mock engines + controller +
gateway), measure the routed tiny requests per second through the gateway for ``--seconds``, the mock
processes' resident memory, and the start-up time. Prints a table, then ONE JSON line
(``instances``, ``runs``: ``processes``, ``routes_per_s``, ``mock_rss_mb``, ``start_s``).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from smetric_lmc.lab.replay.compare import (
    compare,
    comparison_table,
    reasons_side_by_side,
    simulate_like,
    simulate_per_instance,
    warm_up,
    with_kv_tokens,
)
from smetric_lmc.lab.replay.prompts import scale_workload
from smetric_lmc.lab.replay.runner import Record
from smetric_lmc.lab.replay.schedstat import measured_slowdowns
from smetric_lmc.lab.replay.summary import summarize_records
from smetric_lmc.lab.replay.under_load import (
    Contention,
    RequestPath,
    fit_under_load,
    inflight_on_instance,
    run_tps,
    slowed,
    with_turnaround,
)
from smetric_lmc.lab.replay.validate import (
    CALIBRATION_POLICY,
    calibration_tags,
    small_workload,
    validate_real,
)
from smetric_lmc.lab.sim.metrics import SimResult
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


def _tag(r: dict[str, Any]) -> str:
    return f"{r['policy']}-r{r['repeat']}"


def _new_tokens(res: SimResult) -> np.ndarray:
    return res.cols["input"] - res.cols["local_tokens"]


def _by(live: SimResult, sims: list[tuple[SimResult, Contention]], of: Any,
        edges: tuple[tuple[int, int], ...]) -> list[str]:
    """TTFT p50 per bucket of ``of(result)`` (the live column bucketed by the live value, each
    simulated one by its own)."""
    lk = of(live)
    lt = live.cols["first_token"] - live.cols["arrival"]
    got = [(of(s), c.ttft(s)) for s, c in sims]
    out = []
    for lo, hi in edges:
        cells = [f"{np.nanmedian(lt[(lk >= lo) & (lk < hi)]) * 1e3:.1f} ({int(((lk >= lo) & (lk < hi)).sum())})"
                 if ((lk >= lo) & (lk < hi)).any() else "-"]
        for k, t in got:
            m = (k >= lo) & (k < hi)
            cells.append(f"{np.nanmedian(t[m]) * 1e3:.1f} ({int(m.sum())})" if m.any() else "-")
        out.append(f"{lo}-{hi - 1 if hi < 1 << 30 else '+'}: " + " / ".join(cells))
    return out


def _oracle(wl: Any, live: SimResult, idle: Any, r: dict[str, Any], d: dict[str, Any]) -> tuple[Any, float, Contention]:
    fit = fit_under_load(wl, live, idle, RequestPath(r["idle_path_pre_s"], r["path_post_s"]), r["policy"], 2,
                         d["rate"], d["seed"], d["max_think_s"])
    return fit.profile, fit.pre, Contention(fit.pre, 0.0)


def _steal(idle: Any, r: dict[str, Any], signal: str) -> list[Any] | None:
    """Per-engine profiles from a run-share signal (``replay.schedstat``), engines in start order;
    None where the run did not record the signal."""
    if signal == "run_share_all" and "sched" not in r:
        # earlier runs recorded the whole engine's share as run_share
        rep, cal = r.get("run_share"), r.get("run_share_calibration")
    elif "sched" in r:
        rep = r["sched"][signal]
        cal = {k: (r["sched_calibration"][0][signal][k] + r["sched_calibration"][1][signal][k]) / 2 for k in rep}
    else:
        return None
    if not rep or not cal:
        return None
    slow = measured_slowdowns(r["slowdown"], cal, rep)
    return [slowed(idle, slow[k]) for k in sorted(slow)]


def ablation(work: Path) -> None:
    """Each part of the real-engine model against a validation's outputs (``--ablation``)."""
    rows = json.loads((work / "validation.json").read_text())
    idle = load_profile(work / "calibrated.yaml")
    d = {k: v.default for k, v in inspect.signature(validate_real).parameters.items()}
    wl = small_workload(d["sessions"], d["turns"], d["context_scale"], d["output_scale"], d["seed"])
    cal_wl = small_workload(d["sessions"], d["turns"], d["context_scale"], d["output_scale"], d["seed"] + 1)
    first = rows[0]
    tags = calibration_tags(len(rows))
    errors: dict[str, list[tuple[float, float]]] = {}
    common = load_profile(work / f"calibrated-under-load-{_tag(first)}.yaml")
    common_ct = Contention(first["path_base_s"], first["path_per_inflight_s"])
    print("| replay | model | tok/s sim | live | err | TTFT p50 sim (s) | live | err | local hit sim | live |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    per_request = []
    for k, r in enumerate(rows):
        pol, tag = r["policy"], _tag(r)
        recs = [Record(**json.loads(x)) for x in (work / f"calibration-{tags[k]}.jsonl").open()]
        before = fit_under_load(cal_wl, summarize_records(recs, policy=CALIBRATION_POLICY), idle,
                                RequestPath(r["idle_path_pre_s"], r["path_post_s"]), CALIBRATION_POLICY, 2, d["rate"],
                                d["seed"] + 1, d["max_think_s"])
        live = summarize_records([Record(**json.loads(x)) for x in (work / f"{tag}.jsonl").open()], policy=pol)
        loaded = load_profile(work / f"calibrated-under-load-{tag}.yaml")
        post = r["path_post_s"]
        ct = Contention(r["path_base_s"], r["path_per_inflight_s"])
        const = Contention(r["path_pre_s"], 0.0)
        sims = []
        for name, prof, pre, path in (("idle", idle, None, None), ("+ idle path", idle, r["idle_path_pre_s"], None),
                                      ("+ slowdown", loaded, r["idle_path_pre_s"], None),
                                      ("before only, const", before.profile, before.pre, Contention(before.pre, 0.0)),
                                      ("before only", before.profile, before.pre, before.contention),
                                      ("fitted const", loaded, r["path_pre_s"], const),
                                      ("fitted", loaded, r["path_pre_s"], ct),
                                      ("fitted, KV unbounded", with_kv_tokens(loaded, 1 << 24), r["path_pre_s"], ct),
                                      ("common profile", common, first["path_pre_s"], common_ct),
                                      ("measured steal", _steal(idle, r, "run_share"), r["path_pre_s"], ct),
                                      ("measured steal, all threads", _steal(idle, r, "run_share_all"),
                                       r["path_pre_s"], ct),
                                      ("oracle speed", *_oracle(wl, live, idle, r, d))):
            turn = 0.0 if pre is None else pre + post
            if isinstance(prof, list):
                sim = simulate_per_instance(with_turnaround(wl, turn, 0.0), prof, pol, d["rate"], d["seed"], 1e9)
            elif prof is None:
                continue  # a signal this run did not record
            else:
                sim = simulate_like(with_turnaround(wl, turn, 0.0), prof, pol, 2, d["rate"], d["seed"], 1e9)
            tps = run_tps(sim, 0.0 if pre is None else post)
            ttft = float(np.nanmedian(path.ttft(sim))) if path else sim.summary["ttft_p50"] + (pre or 0.0)
            if name in ("fitted const", "fitted"):
                sims.append((sim, path))
            lt, lf = run_tps(live), live.summary["ttft_p50"]
            errors.setdefault(name, []).append((abs(tps / lt - 1), abs(ttft / lf - 1)))
            print(f"| {tag} | {name} | {tps:.0f} | {lt:.0f} | {tps / lt - 1:+.0%} | {ttft:.3f} | {lf:.3f} | "
                  f"{ttft / lf - 1:+.0%} | {sim.summary['hit_local']:.3f} | {live.summary['hit_local']:.3f} |")
        per_request.append((tag, _by(live, sims, inflight_on_instance, ((0, 1), (1, 2), (2, 4), (4, 1 << 30))),
                            _by(live, sims, _new_tokens, ((0, 64), (64, 512), (512, 1 << 30)))))
    print("\nTTFT p50 (ms, requests) by other requests in flight on the serving engine at arrival: "
          "live / sim constant path / sim load-dependent path")
    for tag, lines, _ in per_request:
        print(f"{tag}: " + "; ".join(lines))
    print("\nTTFT p50 (ms, requests) by prompt tokens not cached (prefilled): live / sim constant path / "
          "sim load-dependent path")
    for tag, _, lines in per_request:
        print(f"{tag}: " + "; ".join(lines))
    print(f"\n|error| over the {len(rows)} replays: model | throughput mean, max | TTFT p50 mean, max")
    for name, e in errors.items():
        a = np.array(e)
        print(f"| {name} | {a[:, 0].mean():.1%}, {a[:, 0].max():.1%} | {a[:, 1].mean():.1%}, {a[:, 1].max():.1%} |")
    print("\nsimulated local hit, tok/s as the engines slow down (x the idle iteration time), by KV blocks per "
          "engine (32 tokens each):")
    turn = first["path_pre_s"] + first["path_post_s"]
    for blocks in KV_BLOCKS:
        prof = with_kv_tokens(idle, blocks * 32)
        for pol in dict.fromkeys(r["policy"] for r in rows):
            cells = []
            for f in (1.5, 2.0, 3.5, 5.0, 8.0):
                sim = simulate_like(with_turnaround(wl, turn, 0.0), slowed(prof, f), pol, 2, d["rate"], d["seed"], 1e9)
                cells.append(f"x{f:g}: {sim.summary['hit_local']:.3f}, {run_tps(sim):.0f}")
            print(f"{blocks} blocks, {pol}: " + " | ".join(cells))


KV_BLOCKS = (320, 400, 480, 640)


def mock_scaling(instances: int, processes: str, seconds: float) -> None:
    """Routed requests/s, mock RSS and start-up time per mock process count (``--mock-scaling``)."""
    import yaml

    from smetric_lmc.lab.mock_engine.stack import bring_up_mock
    from smetric_lmc.workers import launch

    rows = []
    for procs in (int(x) for x in processes.split(",")):
        work = Path(tempfile.mkdtemp(prefix=f"smetric-mock-{procs}p-"))
        ns = argparse.Namespace(mock=instances, mock_processes=procs, host="127.0.0.1",
                                port=0, policy="smetric", mock_args="--speed 50")
        t0 = time.perf_counter()
        stack = bring_up_mock(ns, work)
        start_s = time.perf_counter() - t0
        try:
            warm_up(stack.gateway_url, yaml.safe_load(stack.config_path.read_text())["server"]["route_url"])
            rps = probe_routes(stack.gateway_url, seconds)
            rss = sum(launch.group_rss_bytes(p.pid) for p in stack.processes[:procs] if p.pid)
        finally:
            stack.stop()
        rows.append({"processes": procs, "routes_per_s": round(rps, 1), "mock_rss_mb": round(rss / 2**20, 1),
                     "start_s": round(start_s, 1)})
        print(f"{procs} process(es): {rps:.0f} routed requests/s, mock RSS {rss / 2**20:.0f} MB, "
              f"stack up in {start_s:.1f} s", flush=True)
    print(json.dumps({"instances": instances, "runs": rows}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--ablation", metavar="WORKDIR", type=Path,
                      help="each part of the real-engine model against the folder `smetric sim validate --out` "
                           "wrote (its real/ folder)")
    mode.add_argument("--mock-scaling", action="store_true",
                      help="mock engines in 1, 2 or 4 processes (--processes): routes/s, RSS, start-up")
    ap.add_argument("--processes", default="1,2,4", help="--mock-scaling: comma list of mock process counts")
    ap.add_argument("--seconds", type=float, default=10.0, help="--mock-scaling: seconds of routing per count")
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
    if args.ablation:
        if not (args.ablation / "validation.json").is_file():
            ap.error(f"--ablation: no validation.json in {args.ablation}")
        ablation(args.ablation)
        return 0
    if args.mock_scaling:
        mock_scaling(args.mock_instances, args.processes, args.seconds)
        return 0
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
