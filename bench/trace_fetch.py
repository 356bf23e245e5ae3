"""Decision traces at one cell of bench/prices.py part 3 (issue 23): why does smetric_ect lose at a slow
fetch path? Development tool: run it on arrival seeds 1 and 2, never on the judged seed 0.

    python bench/trace_fetch.py --gbs 0.8 --tier 0.4 --seed 1 [--policies smetric_ect,lmetric,smetric,dynamo]

The cell is built as bench/prices.py part 3 builds it (trace1, x = 0.3, 8 instances, 300 roots, a
1,200 s window, its first 40% warm-up); the knee rate comes from the same two SMetric pilots. Each
policy then runs at --factors x that rate with hooks that record, per request, the routing decision
(reason, predicted local and global hit, the chosen instance's and the holder's in-flight count and
queued prefill), what the engine really found at admission (local, global tokens, load time), and
the time its instance's batch stood still waiting for sync loads while it decoded. It prints, per
policy and rate: TPS within SLO, SLO attainment split TTFT / TPOT, moves, the fetch survival
(tokens fetched ÷ tokens a decision predicted it would fetch), sync-load stall overlap of the
requests that failed TPOT vs those that passed, and the learned prices against the true ones.

    python bench/trace_fetch.py --paired --gbs 0.8 --tier 0.4,full --seed 1,2 [--set KEY=VALUE]
        [--instances 16 --baselines bailian:0.5,lmetric --jobs 2]

runs, untraced, smetric_ect, LMetric, SMetric and Dynamo (or --baselines) at the same arrivals and rates (--factors,
default 0.5-0.7 x the knee: the knee search's peaks sit at 0.6 on these cells, its grid steps are 0.4,
0.6, 0.8) and prints, per cell and seed, the variant's TPS within SLO ÷ each baseline's at each rate
and summed over the rates: a paired comparison near the knee that does not hang on the one run the
knee search credits.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import msgspec
import numpy as np

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.cluster import Simulator
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.sim.engine import Instance
from smetric_lmc.lab.sim.knee import Setting, knee_sweeps
from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.sim.regime_map import MapSpec, _cfg, build_workloads
from smetric_lmc.policy.registry import Policy
from smetric_lmc.policy.smetric_ect import ECTParams

PROFILE = "qwen3-30b-a3b-h20"


def _overlap(iv: list[tuple[float, float]], a: float, b: float) -> float:
    s = 0.0
    for x, y in iv:
        lo, hi = max(x, a), min(y, b)
        if hi > lo:
            s += hi - lo
    return s


def ect_parts(view: Any, p: ECTParams) -> list[tuple[float, float, float, float]]:
    """Per instance, smetric_ect's cost split: (queue, compute x (1 + load), fetch x (1 + load), drag)."""
    L, g, c = view.prompt_tokens, view.global_hit, view.local_hit
    free_us = 1e6 * p.slack_share * (p.slo_ttft_s + p.slo_ttft_s_per_tok * L)
    out = []
    for i, (ci, li, q) in enumerate(zip(c, view.in_flight, view.unprefilled)):
        pr = view.prices[i]
        nf = max(0, g - ci)
        drag = pr.inflight_us + (pr.mean_output or p.mean_output) * pr.decode_us_per_req
        out.append(
            (
                max(0.0, pr.queue_us_per_tok * q - free_us),
                pr.prefill_token_us(L) * (L - max(ci, g)) * (1 + li),
                pr.fetch_us(nf) * (1 + li),
                drag * li,
            )
        )
    return out


def pred_ttft(view: Any) -> list[float]:
    """Per instance, the request's TTFT (s) the learned TTFT model predicts there."""
    L, g, c = view.prompt_tokens, view.global_hit, view.local_hit
    out = []
    for ci, li, q, pr in zip(c, view.in_flight, view.unprefilled, view.prices):
        us = (pr.fixed_us + pr.prefill_token_us(L) * (L - max(ci, g)) + pr.fetch_us(max(0, g - ci))
              + pr.queue_us_per_tok * q + pr.inflight_us * li)  # fmt: skip
        out.append(us / 1e6)
    return out


def traced_run(wl: Any, cfg: Any, prof: Any, policy: PolicyConfig) -> dict[str, Any]:
    sim = Simulator(wl, cfg, policy, prof)
    dec: dict[str, dict[str, Any]] = {}
    stalls: list[list[tuple[float, float]]] = [[] for _ in sim.instances]
    done: list[dict[str, Any]] = []
    route0 = sim.router.route
    load = sim.load
    last: dict[str, Any] = {}

    def route(rid: str, blocks: Any, chunks: Any, L: int, **kw: Any) -> Any:
        found = sim.index.lookup(blocks, chunks) if blocks else None
        best_hit, holders = found.best() if found is not None else (0, None)
        ids = sim.index.instances
        holder = ids[holders[0]] if holders else None
        infl = {i: float(load.in_flight(i)) for i in ids}
        unp = {i: float(load.unprefilled(i)) for i in ids}
        last.clear()
        d = route0(rid, blocks, chunks, L, **kw)
        iid = d.instance_id
        parts = last.get("parts")
        dec[rid] = {"reason": d.reason.value, "c": d.local_hit_tokens, "g": d.global_hit_tokens, "best": best_hit,
                    "L": L, "turn": d.turn, "moved": holder is not None and iid != holder and best_hit > d.local_hit_tokens,
                    "infl_to": infl[iid], "unp_to": unp[iid],
                    "infl_holder": infl[holder] if holder else math.nan, "unp_holder": unp[holder] if holder else math.nan,
                    "mean_infl": sum(infl.values()) / len(infl),
                    "parts_to": parts[ids.index(iid)] if parts else None,
                "fetch_price": last.get("fetch_price", math.nan),
                "pred_to": last["pred_ttft"][ids.index(iid)] if "pred_ttft" in last else math.nan,
                "pred_holder": last["pred_ttft"][ids.index(holder)] if "pred_ttft" in last and holder else math.nan,
                    "parts_holder": parts[ids.index(holder)] if parts and holder else None}  # fmt: skip
        return d

    sim.router.route = route  # type: ignore[method-assign]
    pol0 = sim.router._policy
    if pol0.name == "smetric_ect":
        p = ECTParams.from_params(policy.params, policy.hit_ratio)

        def decide(view: Any) -> Any:
            ch = pol0(view)
            last["parts"] = ect_parts(view, p)
            last["fetch_price"] = view.prices[0].fetch_global_us
            last["pred_ttft"] = pred_ttft(view)
            return ch

        sim.router._policy = Policy(pol0.name, decide, pol0.needs)
    fin0 = sim.on_finish

    def on_finish(r: Any, t: float) -> None:
        done.append({"rid": r.rid, "pos": r.inst.pos, "arrival": r.arrival, "first": r.first_token, "finish": t,
                     "input": r.input, "output": r.output, "local": r.local_tokens, "glob": r.global_tokens,
                     "load_s": r.load_s, "turn": r.turn})  # fmt: skip
        fin0(r, t)

    sim.on_finish = on_finish  # type: ignore[method-assign]
    fa0 = Instance._fetch_all

    def fetch_all(self: Instance, loads: Any, now: float, cb: Any) -> None:
        def cb2(t: float) -> None:
            stalls[self.pos].append((now, t))
            cb(t)

        fa0(self, loads, now, cb2)

    Instance._fetch_all = fetch_all  # type: ignore[method-assign]
    try:
        res = sim.run()
    finally:
        Instance._fetch_all = fa0  # type: ignore[method-assign]
    s = res.summary
    slo = cfg.slo
    w0, w1 = sim.measure_from, sim.last_root_start
    rows = [dict(x, **dec.get(x["rid"], {})) for x in done]
    inw = [x for x in rows if w0 <= x["finish"] <= w1]
    out: dict[str, Any] = {k: s.get(k) for k in ("tps_slo", "slo_attainment", "ttft_attainment", "tpot_attainment",
                                                  "hit_local", "hit_global", "hit_miss", "stall_share", "gpu_busy_share",
                                                  "reasons", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")}  # fmt: skip
    for x in inw:
        x["ttft"] = x["first"] - x["arrival"]
        x["tpot"] = (x["finish"] - x["first"]) / (x["output"] - 1) if x["output"] > 1 else 0.0
        x["ttft_ok"] = x["ttft"] <= slo.ttft_limit(x["input"]) + 1e-9
        x["tpot_ok"] = x["tpot"] <= slo.tpot_s + 1e-9
        x["stall_in_decode"] = _overlap(stalls[x["pos"]], x["first"], x["finish"]) if x["output"] > 1 else 0.0
        x["pred_fetch"] = max(0, x.get("g", 0) - x.get("c", 0))
    tok = sum(x["input"] + x["output"] for x in inw)
    lost_ttft = sum(x["input"] + x["output"] for x in inw if not x["ttft_ok"])
    lost_tpot = sum(x["input"] + x["output"] for x in inw if x["ttft_ok"] and not x["tpot_ok"])
    out["tokens_lost_share"] = {"ttft": lost_ttft / max(1, tok), "tpot_only": lost_tpot / max(1, tok)}
    fol = [x for x in inw if x.get("turn", 0) > 0]
    mv = [x for x in fol if x.get("moved")]
    out["followups"] = len(fol)
    out["moved_share"] = len(mv) / max(1, len(fol))
    if mv:
        out["moved"] = {
            "L": float(np.mean([x["L"] for x in mv])), "best_hit": float(np.mean([x["best"] for x in mv])),
            "pred_fetch": float(np.mean([x["pred_fetch"] for x in mv])), "fetched": float(np.mean([x["glob"] for x in mv])),
            "load_s": float(np.mean([x["load_s"] for x in mv])),
            "fetch_price": float(np.nanmean([x.get("fetch_price", math.nan) for x in mv])),
            "ttft": float(np.mean([x["ttft"] for x in mv])),
            "ttft_slo": float(np.mean([slo.ttft_limit(x["input"]) for x in mv])), "ttft_ok": float(np.mean([x["ttft_ok"] for x in mv])),
            "tpot_ok": float(np.mean([x["tpot_ok"] for x in mv])),
            "infl_holder": float(np.nanmean([x["infl_holder"] for x in mv])), "infl_to": float(np.mean([x["infl_to"] for x in mv])),
            "unp_holder": float(np.nanmean([x["unp_holder"] for x in mv])), "unp_to": float(np.mean([x["unp_to"] for x in mv])),
        }  # fmt: skip
        sl = [(x["pred_to"], x["pred_holder"], slo.ttft_limit(x["input"]), x["ttft_ok"]) for x in mv
              if x.get("pred_to", math.nan) == x.get("pred_to") and x.get("pred_holder", math.nan) == x.get("pred_holder")]
        if sl:
            a = np.array(sl, dtype=float)
            bad = (a[:, 0] > a[:, 2]) & (a[:, 1] <= a[:, 2])
            out["moved"]["pred_to_s"] = float(a[:, 0].mean())
            out["moved"]["pred_holder_s"] = float(a[:, 1].mean())
            # moves predicted to break the SLO where staying was predicted to keep it, and how they did
            out["moved"]["into_slo_miss_share"] = float(bad.mean())
            out["moved"]["into_slo_miss_ttft_ok"] = float(a[bad, 3].mean()) if bad.any() else math.nan
            out["moved"]["rest_ttft_ok"] = float(a[~bad, 3].mean()) if (~bad).any() else math.nan
        pt = [x["parts_to"] for x in mv if x.get("parts_to") and x.get("parts_holder")]
        ph = [x["parts_holder"] for x in mv if x.get("parts_to") and x.get("parts_holder")]
        if pt:
            # mean cost parts (ms): queue, compute, fetch, drag; on the chosen instance and on the holder
            out["moved"]["parts_to_ms"] = [round(float(v) / 1e3, 1) for v in np.mean(pt, axis=0)]
            out["moved"]["parts_holder_ms"] = [round(float(v) / 1e3, 1) for v in np.mean(ph, axis=0)]
    st = [x for x in fol if not x.get("moved")]
    if st:
        out["stayed"] = {"ttft_ok": float(np.mean([x["ttft_ok"] for x in st])),
                         "tpot_ok": float(np.mean([x["tpot_ok"] for x in st])),
                         "fetched": float(np.mean([x["glob"] for x in st])),
                         "recomputed": float(np.mean([x["input"] - x["local"] - x["glob"] for x in st]))}  # fmt: skip
    pf = [x for x in inw if x["pred_fetch"] > 0]
    if pf:
        got = sum(min(x["glob"], x["pred_fetch"]) for x in pf)
        out["survival"] = {"requests": len(pf), "fetched_over_predicted": got / sum(x["pred_fetch"] for x in pf),
                           "half_lost_share": float(np.mean([x["glob"] < 0.5 * x["pred_fetch"] for x in pf]))}  # fmt: skip
    dcd = [x for x in inw if x["output"] > 1 and x["ttft_ok"]]
    bad = [x for x in dcd if not x["tpot_ok"]]
    good = [x for x in dcd if x["tpot_ok"]]
    out["tpot"] = {
        "fail": len(bad), "pass": len(good),
        "stall_in_decode_fail": float(np.mean([x["stall_in_decode"] for x in bad])) if bad else 0.0,
        "stall_in_decode_pass": float(np.mean([x["stall_in_decode"] for x in good])) if good else 0.0,
        "decode_s_fail": float(np.mean([x["finish"] - x["first"] for x in bad])) if bad else 0.0,
        # would it pass with the sync-load stalls it sat through removed?
        "fail_saved_without_stalls": float(np.mean([(x["finish"] - x["first"] - x["stall_in_decode"]) / (x["output"] - 1)
                                                    <= slo.tpot_s for x in bad])) if bad else 0.0,
    }  # fmt: skip
    tt_bad = [x for x in inw if not x["ttft_ok"]]
    out["ttft_fail"] = {"n": len(tt_bad), "fetched_share": float(np.mean([x["glob"] > 0 for x in tt_bad])) if tt_bad else 0.0,
                        "moved_share": float(np.mean([bool(x.get("moved")) for x in tt_bad])) if tt_bad else 0.0,
                        "mean_load_s": float(np.mean([x["load_s"] for x in tt_bad])) if tt_bad else 0.0}  # fmt: skip
    fp = [(x["arrival"], x["fetch_price"]) for x in rows if x.get("fetch_price", math.nan) == x.get("fetch_price")]
    if fp:
        fp.sort()
        # instance 0's decision price at decisions (arrival time, µs/token)
        out["fetch_price_over_time"] = [(round(t), round(v, 1)) for t, v in fp[:: max(1, len(fp) // 12)]]
        out["measure_from_s"] = round(w0)
    tot_stall = sum(b - a for iv in stalls for a, b in iv)
    out["sync_stall_s_per_instance"] = tot_stall / len(stalls)
    if sim.price_feed is not None:
        p = sim.price_feed.book.pooled.prices()
        book = sim.price_feed.book
        # each instance's own fit and the price its decisions used, at the end of the run
        out["own_fetch_end"] = [round(book.prices(i).fetch_global_us, 1) for i in book.instances()]
        out["decision_fetch_end"] = [round(book.decision_prices(i).fetch_global_us, 1) for i in book.instances()]
        out["learned"] = {k: round(getattr(p, k), 2) for k in ("fetch_global_us", "fetch_global_fixed_us", "prefill_us",
                                                               "prefill_us_per_ktok", "queue_us_per_tok", "inflight_us",
                                                               "decode_us", "decode_us_per_req", "mean_output")}  # fmt: skip
    return out


def _cell(gbs: float, tier: str, seed: int, prof: Any, instances: int = 8) -> tuple[Any, str, Any, Any, float]:
    """(workloads, workload key, the cell's config, its profile, its knee rate), as part 3 builds them
    (on ``--map-instances`` instances)."""
    spec = MapSpec(xs=(0.3,), tiers=(tier,), instances=instances, pool_roots=300, window_s=1200.0,
                   seeds=(seed,), pilots=2, rate_factors=(1.0,))  # fmt: skip
    base = load_sim_config(None, fetch_gbs=gbs)
    wls, per_x = build_workloads(spec, prof)
    scale, xprof = per_x[0.3]
    wkey = "scale1" if scale == 1.0 else "x0.3"
    cfg = msgspec.structs.replace(_cfg(base, spec, tier, 1.0), seed=base.seed + seed)
    # the knee rate: the map's two SMetric pilots (knee_sweeps with no policy to sweep)
    kr = knee_sweeps(wls, {"c": Setting(wkey, cfg, xprof)}, [], PolicyConfig(name="smetric"), (1.0,), 1, 2)
    return wls, wkey, cfg, xprof, kr["c"].knee_rate


def paired(a: argparse.Namespace, prof: Any, params: dict[str, float]) -> None:
    from smetric_lmc.lab.sim.batch import Task, run_tasks

    factors = [float(v) for v in a.factors.split(",")]
    names = a.baselines.split(",")
    pols = [PolicyConfig(name="smetric_ect", params=params)] + [_baseline(n) for n in names]
    tot = np.zeros(len(pols))
    for tier in a.tier.split(","):
        for seed in (int(v) for v in a.seed.split(",")):
            wls, wkey, cfg, xprof, knee = _cell(a.gbs, tier, seed, prof, a.instances)
            tasks = [Task(wkey, msgspec.structs.replace(cfg, rate=knee * f), p, xprof) for f in factors for p in pols]
            sc = np.array([r.score for r in run_tasks(wls, tasks, a.jobs, desc="paired")]).reshape(len(factors), len(pols))
            tot += sc.sum(axis=0)
            print(f"{a.gbs:g} GB/s, global {tier}, seed {seed}, {a.instances} instances: variant ÷ {names[0]} per rate "
                  f"{np.round(sc[:, 0] / sc[:, 1], 3).tolist()}; summed over the rates "
                  + ", ".join(f"÷ {n} {sc[:, 0].sum() / sc[:, k + 1].sum():.3f}" for k, n in enumerate(names)),
                  flush=True)  # fmt: skip
    print("all: variant " + ", ".join(f"÷ {n} {tot[0] / tot[k + 1]:.3f}" for k, n in enumerate(names)))


def _baseline(name: str) -> PolicyConfig:
    """A baseline by name; ``bailian:0.5`` is Bailian at λ = 0.5 (part 3 tunes λ per cell on seed 1)."""
    if name.startswith("bailian:"):
        return PolicyConfig(name="bailian", bailian_lambda=float(name.split(":", 1)[1]))
    return PolicyConfig(name=name)  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gbs", type=float, default=0.8)
    ap.add_argument("--tier", default="0.4", help="global tier (--paired: a comma list)")
    ap.add_argument("--seed", default="1", help="arrival seed, never 0 (--paired: a comma list)")
    ap.add_argument("--paired", action="store_true", help="untraced paired comparison near the knee (see above)")
    ap.add_argument("--policies", default="smetric_ect,lmetric,smetric,dynamo")
    ap.add_argument("--factors", default="", help="rates x the knee (default 0.8,1.0,1.25; --paired 0.5-0.7)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a smetric_ect parameter")
    ap.add_argument("--instances", type=int, default=8, help="the cell's instances (part 3's --map-instances)")
    ap.add_argument("--baselines", default="lmetric,smetric,dynamo",
                    help="--paired: the policies the variant is compared with (bailian:LAMBDA for a tuned Bailian)")
    ap.add_argument("--jobs", type=int, default=1, help="--paired: simulations run at once")
    a = ap.parse_args()
    if 0 in [int(v) for v in a.seed.split(",")]:
        raise SystemExit("seed 0 is the judged seed: trace on 1 or 2")
    a.factors = a.factors or ("0.5,0.55,0.6,0.65,0.7" if a.paired else "0.8,1.0,1.25")
    prof = load_profile(PROFILE)
    if a.paired:
        paired(a, prof, {k: float(v) for k, v in (kv.split("=", 1) for kv in a.set)})
        return
    t0 = time.monotonic()
    wls, wkey, cfg, xprof, knee = _cell(a.gbs, a.tier, int(a.seed), prof, a.instances)
    print(f"knee {knee:.4g} sessions/s ({time.monotonic() - t0:.0f} s)", flush=True)
    params = {k: float(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    for f in (float(v) for v in a.factors.split(",")):
        for name in a.policies.split(","):
            pol = PolicyConfig(name=name, params=params) if name.startswith("smetric_ect") else _baseline(name)  # type: ignore[arg-type]
            t1 = time.monotonic()
            out = traced_run(wls[wkey], msgspec.structs.replace(cfg, rate=knee * f), xprof, pol)
            print(
                json.dumps(
                    {"policy": name, "factor": f, "wall_s": round(time.monotonic() - t1, 1), **out},
                    default=lambda v: round(v, 4) if isinstance(v, float) else str(v),
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
