"""Learned prices (issue 23): does the router's price estimator (smetric_lmc.prices) find the
cluster's true prefill and fetch prices, follow a 4x slowdown of the fetch path, and does the
variant that prices with them (smetric_ect) beat the baselines over the fetch-speed axis?

    python bench/prices.py [--quick] [--jobs 2]

Four parts, each printed as it finishes, then ONE JSON line:

1. Simulator, learned vs true: smetric_ect on the trace1 preset with the global tier full and a
   slow fetch path (--sim-gbs GB/s per request: its price is ~15x the cold-start prior). The true
   prices are read off the profile and the fetch path by this script; the router never reads them.
   Errors are the pooled (cluster) estimate's after --requests done reports (2,000 by default).
2. Simulator, a 4x slowdown mid-run: the same cluster with the fetch path 4x slower (per-request
   throughput / 4, lookup x 4) from 40% of the run, against a run that started slow (same seed).
   adapt_s: the shortest time T after the step such that the stepped run's TPS within SLO over the
   rest of the run (from step + T, in 120 s windows, summed over the seeds) is within 5% of the
   started-slow run's; price_adapt_s: until the learned fetch price is within 20% of the new one.
   The same pair is run with LMetric as a control: it prices nothing, so its adapt_s is what the
   criterion costs a router that has nothing to learn (the cluster's own state, run-to-run noise).
3. Simulator, the fetch-speed axis x global-tier provisioning: the regime map's knee search (as
   `smetric sim report`) per cell and arrival seed (--seeds: 0, 3 and 4), every policy at its own
   knee, its score in a cell the mean over the seeds; the learning variant ÷ the best
   baseline, ÷ LMetric, ÷ tuned Bailian, ÷ the fixed-price variant (smetric_ect_fixed: the same
   cost at the configured prices) and ÷ SMetric per cell. Bailian's λ is tuned per cell on seed 1
   (never a judged seed): each λ of BAILIAN_LAMBDAS runs its own knee search there, the best is
   judged beside its default.
4. Live, mock engines: real HTTP mock vLLM engines (this process's event loop) with a shared global
   tier whose retrieve path is set (--live-gbps, lookup, per-chunk); each session's turns go to
   different instances, so every reuse is a global-tier fetch. The estimator (the controller's
   PriceFeed) learns from each request's measured TTFT and the engine's cached tokens; after
   --requests requests the fetch path slows 4x (POST /mock/retrieve) and the run goes on.

variant_knobs_tuned_on_eval counts smetric_ect's parameters whose defaults were chosen on the
workloads it is judged on (0 since this issue: every default is a profile reading, a guess the data
replaces, or derived from the SLO; smetric_ect.py says which).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import statistics as st
import sys
import time
from typing import Any

import numpy as np

from smetric_lmc.config import PolicyConfig
from smetric_lmc.lab.sim.cluster import Simulator
from smetric_lmc.lab.sim.config import SimConfig, load_sim_config
from smetric_lmc.lab.sim.fetch_path import LMCACHE_CHUNK_TOKENS, FetchPath
from smetric_lmc.lab.sim.profile import Profile, load_profile
from smetric_lmc.lab.workload.model import Workload
from smetric_lmc.lab.workload.presets import preset_workload
from smetric_lmc.prices import PriceFeed

PROFILE = "qwen3-30b-a3b-h20"
VARIANT, FIXED, CONTROL = "smetric_ect", "smetric_ect_fixed", "lmetric"


def log(msg: str) -> None:
    print(msg, flush=True)


def cpu_times() -> list[float] | None:
    """The machine's CPU time counters (/proc/stat's first line), or None where unreadable."""
    try:
        with open("/proc/stat") as f:
            vals = [float(v) for v in f.readline().split()[1:]]
        return vals if len(vals) > 7 else None
    except OSError:
        return None


def steal_since(t0: list[float] | None) -> float | None:
    """Share of the machine's CPU time stolen since the counters ``t0``."""
    t1 = cpu_times()
    if t0 is None or t1 is None:
        return None
    d = [b - a for a, b in zip(t0, t1)]
    return round(d[7] / sum(d), 4) if sum(d) > 0 else None


# ---- true prices (read by this script only) ------------------------------------------------------


def true_fetch_us(prof: Profile, fp: FetchPath) -> tuple[float, float]:
    """(µs per token, µs fixed per request) of a lone fetch over the path: bytes at the per-request
    throughput (links are faster here), per-chunk costs spread per token, the lookup fixed."""
    per_tok = prof.kv_bytes_per_token / min(fp.request_bps, prof.link_bytes_per_s, prof.host_link_bytes_per_s)
    per_tok += fp.per_chunk_s / LMCACHE_CHUNK_TOKENS
    return per_tok * 1e6, fp.lookup_s * 1e6


def true_prefill_us(prof: Profile, context: int) -> float:
    """µs per token of a 2,048-token prefill chunk ending at ``context`` (its iteration less an empty one)."""
    n = min(2048, context)
    return (prof.iteration_time([(n, context - n)], 0, 0) - prof.iteration_time([], 0, 0)) / n * 1e6


# ---- part 1: learned vs true in the simulator ------------------------------------------------------


def _workload(prof: Profile, roots: int, seed: int = 0) -> Workload:
    return preset_workload("trace1", roots, seed=seed, context_limit=int(0.9 * prof.max_context(64)))


def _cfg(instances: int, gbs: float, rate: float, window_s: float, seed: int = 0) -> SimConfig:
    return load_sim_config(None, instances=instances, global_tier="full", fetch_gbs=gbs, rate=rate,
                           sampling="replace", arrival_window_s=window_s, drain=False, seed=seed)  # fmt: skip


def _capture_at(feed: PriceFeed, n: int, out: dict[str, Any], clock: Any = None) -> None:
    """Record the pooled estimate when the n-th done report has been learnt from."""
    inner = feed.on_done

    def on_done(*a: Any, **kw: Any) -> bool:
        ok = inner(*a, **kw)
        if ok and feed.stats["observed"] == n:
            out["at_n"] = feed.book.pooled.prices()
            out["retrieve_at_n"] = feed.book.pooled.retrieve_prices()
        return ok

    feed.on_done = on_done  # type: ignore[method-assign]


def sim_accuracy(a: argparse.Namespace, prof: Profile) -> dict[str, Any]:
    cfg = _cfg(a.instances, a.sim_gbs, a.rate, a.window)
    wl = _workload(prof, 400)
    sim = Simulator(wl, cfg, PolicyConfig(name=VARIANT), prof)
    assert sim.price_feed is not None
    got: dict[str, Any] = {}
    _capture_at(sim.price_feed, a.requests, got)
    t0 = time.monotonic()
    sim.run()
    learned = got.get("at_n", sim.price_feed.book.pooled.prices())
    n = min(a.requests, sim.price_feed.stats["observed"])
    f_true, f_fixed = true_fetch_us(prof, cfg.fetch())
    ctx = int(st.median(int(v) for v in sim.rec.columns()["input"]))
    p_true = true_prefill_us(prof, ctx)
    out = {
        "requests": n, "wall_s": round(time.monotonic() - t0, 1),
        "fetch_true_us": round(f_true, 2), "fetch_learned_us": round(learned.fetch_global_us, 2),
        "fetch_fixed_true_us": round(f_fixed, 1), "fetch_fixed_learned_us": round(learned.fetch_global_fixed_us, 1),
        "prefill_context": ctx, "prefill_true_us": round(p_true, 2),
        "prefill_learned_us": round(learned.prefill_token_us(ctx), 2),
        "fetch_price_rel_err": round(abs(learned.fetch_global_us / f_true - 1), 4),
        "prefill_price_rel_err": round(abs(learned.prefill_token_us(ctx) / p_true - 1), 4),
    }
    # the retrieve fit (the retrieves the engines' metrics would show; it decides nothing)
    retrieve = got.get("retrieve_at_n") if "at_n" in got else sim.price_feed.book.pooled.retrieve_prices()
    if retrieve:
        out.update(retrieve_fit_fetch_us=round(retrieve["fetch_global_us"], 2),
                   retrieve_fit_fetch_rel_err=round(abs(retrieve["fetch_global_us"] / f_true - 1), 4))
    log(f"[1] sim, {n} done reports ({out['wall_s']} s): fetch {out['fetch_learned_us']} µs/token learned vs "
        f"{out['fetch_true_us']} true (prior 4.0; the retrieve fit {out.get('retrieve_fit_fetch_us')}); "
        f"prefill at {ctx} tokens {out['prefill_learned_us']} vs {out['prefill_true_us']} µs/token")
    return out


# ---- part 2: a 4x slowdown mid-run ---------------------------------------------------------------------


def _slower(fp: FetchPath, k: float) -> FetchPath:
    return dataclasses.replace(fp, name=f"{fp.name}/{k:g}", request_gbs=fp.request_gbs / k, lookup_s=fp.lookup_s * k,
                               per_chunk_s=fp.per_chunk_s * k)  # fmt: skip


def _tps_windows(sim: Simulator, w: float, end: float) -> np.ndarray:
    """Tokens per second of requests within their SLO, per window of ``w`` s finishing before ``end``."""
    c = sim.rec.columns()
    slo = sim.cfg.slo
    ok = ~c["rejected"].astype(bool)
    ttft = c["first_token"] - c["arrival"]
    tpot = np.where(c["output"] > 1, (c["finish"] - c["first_token"]) / np.maximum(c["output"] - 1, 1), 0.0)
    within = ok & (ttft <= slo.ttft_limit(c["input"])) & (tpot <= slo.tpot_s)
    tokens = (c["input"] + c["output"]) * within
    k = int(end // w)
    idx = np.clip((c["finish"] // w).astype(int), 0, k)
    return np.bincount(idx, weights=tokens, minlength=k + 1)[:k] / w


def _stepped_pair(a: argparse.Namespace, prof: Profile, seed: int,
                  policy: str = VARIANT) -> tuple[np.ndarray, np.ndarray, list[tuple[float, float]], float]:
    """(TPS within SLO per window of the stepped run, of the started-slow run, the stepped run's
    learned fetch price over time (empty for a policy that learns none), the new true price) for one
    arrival seed."""
    wl = _workload(prof, 400, seed=seed)
    cfg = _cfg(a.adapt_instances, a.adapt_gbs, a.adapt_rate, a.window, seed=seed)
    step_at = 0.4 * a.window
    stepped = Simulator(wl, cfg, PolicyConfig(name=policy), prof)  # type: ignore[arg-type]
    slow_fp = _slower(cfg.fetch(), 4.0)
    assert stepped.gtier is not None
    gt, feed = stepped.gtier, stepped.price_feed
    trace: list[tuple[float, float]] = []

    def step(t: float) -> None:
        gt.fp = slow_fp

    def sample(t: float) -> None:
        assert feed is not None
        trace.append((t, feed.book.pooled.prices().fetch_global_us))
        if t + 5.0 < a.window:
            stepped.push_call(t + 5.0, sample)

    stepped.push_call(step_at, step)
    if feed is not None:
        stepped.push_call(step_at, sample)
    started_slow = Simulator(wl, cfg, PolicyConfig(name=policy), prof)  # type: ignore[arg-type]
    assert started_slow.gtier is not None
    started_slow.gtier.fp = slow_fp
    stepped.run()
    started_slow.run()
    end = 0.9 * a.window  # the last arrivals' requests are still running at the window's end
    return (_tps_windows(stepped, a.adapt_w, end), _tps_windows(started_slow, a.adapt_w, end), trace,
            true_fetch_us(prof, slow_fp)[0])


def _adapt_s(x: np.ndarray, y: np.ndarray, first: int, w: float, step_at: float) -> float | None:
    """The shortest time T after the step such that TPS within SLO over [step + T, end), summed, is
    within 5% of the started-slow run's (single windows are +-10% noise even before the step: the
    criterion is over the rest of the run, not each window)."""
    for i in range(first, len(x)):
        if y[i:].sum() > 0 and abs(x[i:].sum() / y[i:].sum() - 1) <= 0.05:
            return round(i * w - step_at, 1)
    return None


def _adapt_policy(a: argparse.Namespace, prof: Profile, policy: str) -> dict[str, Any]:
    step_at, w = 0.4 * a.window, a.adapt_w
    xs, ys, price_s = [], [], []
    for sd in a.adapt_seeds:
        x, y, trace, f_new = _stepped_pair(a, prof, sd, policy)
        xs.append(x)
        ys.append(y)
        price_s.append(next((t - step_at for t, v in trace if abs(v / f_new - 1) <= 0.2), math.nan))
        log(f"[2] {policy} seed {sd}: stepped ÷ started-slow per window "
            f"{[round(float(u / v), 3) if v else None for u, v in zip(x, y)]}")
    # paired runs, summed over seeds (the same arrivals in each pair)
    x, y = np.sum(xs, axis=0), np.sum(ys, axis=0)
    ratio = [float(u / v) if v > 0 else math.nan for u, v in zip(x, y)]
    first = int(math.ceil(step_at / w))
    per_seed = [_adapt_s(u, v, first, w, step_at) for u, v in zip(xs, ys)]
    return {"adapt_s": _adapt_s(x, y, first, w, step_at), "adapt_s_per_seed": per_seed,
            "price_adapt_s": [None if v != v else round(v, 1) for v in price_s],
            "tps_ratio_by_window": [round(r, 3) for r in ratio],
            "tps_ratio_after_step": round(float(x[first:].sum() / y[first:].sum()), 4) if y[first:].sum() > 0 else None}


def adapt(a: argparse.Namespace, prof: Profile) -> dict[str, Any]:
    """The variant's adaptation, and the same measurement of LMetric as a control: LMetric prices
    nothing, so its adapt_s is what the cluster's own state (queues, where the KV sits) and the
    divergence of two runs at the knee cost this criterion with no learning at all."""
    t0 = time.monotonic()
    step_at, w = 0.4 * a.window, a.adapt_w
    v = _adapt_policy(a, prof, VARIANT)
    ctl = _adapt_policy(a, prof, CONTROL)
    out = {**v, "control": CONTROL, "control_adapt_s": ctl["adapt_s"], "control_adapt_s_per_seed": ctl["adapt_s_per_seed"],
           "control_tps_ratio_by_window": ctl["tps_ratio_by_window"],
           "control_tps_ratio_after_step": ctl["tps_ratio_after_step"], "window_s": w, "step_at_s": step_at,
           "seeds": list(a.adapt_seeds), "wall_s": round(time.monotonic() - t0, 1)}  # fmt: skip
    log(f"[2] 4x slowdown at {step_at:.0f} s, {len(a.adapt_seeds)} seeds: {VARIANT} TPS within SLO ÷ started-slow per "
        f"{w:.0f} s window {v['tps_ratio_by_window']} (the first {int(math.ceil(step_at / w))} before the step); "
        f"adapt_s {v['adapt_s']} (per seed {v['adapt_s_per_seed']}); after the step overall {v['tps_ratio_after_step']}; "
        f"learned fetch price within 20% of the new one after {v['price_adapt_s']} s")
    log(f"[2] control {CONTROL} (learns nothing): per window {ctl['tps_ratio_by_window']}; adapt_s {ctl['adapt_s']} "
        f"(per seed {ctl['adapt_s_per_seed']}); after the step overall {ctl['tps_ratio_after_step']}")
    return out


# ---- part 3: the fetch-speed axis x provisioning ---------------------------------------------------------


# Bailian's λ is tuned per cell, as the paper tuned its baselines: each value runs its own knee search on
# TUNE_SEED (never one of the judged --seeds) and the best one is judged; 0.9 is its default, 0.5 the
# paper reproduction's tuned best in every setting (docs/paper.md), 0.3 one step past it.
BAILIAN_LAMBDAS = (0.9, 0.7, 0.5, 0.3)
TUNE_SEED = 1


def _bailian_configs() -> dict[str, PolicyConfig]:
    """Label -> config for each λ of the grid; the default keeps the plain name."""
    default = PolicyConfig(name="bailian").bailian_lambda
    return {("bailian" if lam == default else f"bailian λ={lam:g}"): PolicyConfig(name="bailian", bailian_lambda=lam)
            for lam in BAILIAN_LAMBDAS}


def fetch_axis(a: argparse.Namespace, prof: Profile) -> dict[str, Any]:
    from smetric_lmc.lab.sim.regime_map import BASELINES, MapSpec, run_map

    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    lams = _bailian_configs()
    more = tuple(k for k in lams if k not in BASELINES)
    for gbs in a.axis:
        common = dict(xs=(a.x,), tiers=tuple(a.tiers), instances=a.map_instances, pool_roots=a.map_roots,
                      window_s=a.map_window, pilots=a.pilots, rate_factors=a.rate_factors, configs=lams)
        base = load_sim_config(None, fetch_gbs=gbs)
        tune = run_map(MapSpec(seeds=(TUNE_SEED,), baselines=tuple(lams), **common), base, prof, a.jobs)  # type: ignore[arg-type]
        chosen = {c.tier: max(lams, key=c.score) for c in tune.cells}
        log(f"[3] {gbs:g} GB/s: Bailian tuned on seed {TUNE_SEED}: " + ", ".join(
            f"global {t} λ = {lams[lab].bailian_lambda:g} ({tune.cell(a.x, t).score(lab):,.0f} vs default "
            f"{tune.cell(a.x, t).score('bailian'):,.0f})" for t, lab in chosen.items()))
        spec = MapSpec(seeds=a.map_seeds, variant=VARIANT, baselines=BASELINES + more + (FIXED,),
                       variant_policy=PolicyConfig(name=VARIANT, params=a.params), **common)  # type: ignore[arg-type]
        m = run_map(spec, base, prof, a.jobs)
        for c in m.cells:
            judged = BASELINES + ((chosen[c.tier],) if chosen[c.tier] not in BASELINES else ())
            b, bs = c.best_baseline(judged)
            v = c.score(VARIANT)
            row = {"fetch_gbs": gbs, "tier": c.tier, "x": c.x, "best_baseline": b,
                   "bailian_lambda": lams[chosen[c.tier]].bailian_lambda,
                   "vs_best": v / bs if bs else float("nan"),
                   # spread over the seeds of the paired per-seed ratio (same arrivals): the cell's noise
                   "vs_best_seed_sd": c.spread(VARIANT, [b]) if b else float("nan"),
                   # 90% bootstrap interval over the seeds, the best baseline re-chosen in each draw
                   "vs_best_ci90": c.interval(VARIANT, judged),
                   "vs_lmetric": v / c.score("lmetric") if c.score("lmetric") else float("nan"),
                   "vs_bailian_tuned": v / c.score(chosen[c.tier]) if c.score(chosen[c.tier]) else float("nan"),
                   "vs_fixed": v / c.score(FIXED) if c.score(FIXED) else float("nan"),
                   "vs_fixed_ci90": c.interval(VARIANT, [FIXED]),
                   "vs_smetric": v / c.score("smetric") if c.score("smetric") else float("nan")}  # fmt: skip
            rows.append(row)
            if a.show_loads:  # every policy's TPS within SLO at every load it ran, per seed
                for sd, kr in zip(a.map_seeds, c.knees):
                    for pol, by in sorted(kr.by_rate.items()):
                        pts = " ".join(f"{r / kr.knee_rate:.3f}x {v:,.0f}" for r, v in sorted(by.items()))
                        log(f"[3]   seed {sd} {pol}: best {kr.score(pol):,.0f} at {kr.rate_factor[pol]:.3f}x | {pts}")
            lo, hi = row["vs_best_ci90"]
            log(f"[3] {gbs:g} GB/s, global {c.tier}: variant ÷ best ({b}) {row['vs_best']:.3f} (per-seed sd "
                f"{row['vs_best_seed_sd']:.3f}, 90% interval over the seeds {lo:.3f}-{hi:.3f}), ÷ lmetric "
                f"{row['vs_lmetric']:.3f}, ÷ tuned bailian (λ {row['bailian_lambda']:g}) {row['vs_bailian_tuned']:.3f}, "
                f"÷ fixed-price {row['vs_fixed']:.3f} ({row['vs_fixed_ci90'][0]:.3f}-{row['vs_fixed_ci90'][1]:.3f}), ÷ smetric {row['vs_smetric']:.3f} ({time.monotonic() - t0:.0f} s)")
    return {"cells": rows, "wall_s": round(time.monotonic() - t0, 1)}


# ---- part 4: live on mock engines -----------------------------------------------------------------------------


async def _live(a: argparse.Namespace, prof: Profile) -> dict[str, Any]:
    import aiohttp

    from smetric_lmc.controller.engine_metrics import EngineMetricsPoller
    from smetric_lmc.lab.mock_engine.cli import options, running_mocks
    from smetric_lmc.load import LoadTracker

    n_inst = 4
    args = options(instances=n_inst, global_gib=256.0, retrieve_gbps=a.live_gbps, retrieve_lookup_ms=2.0,
                   retrieve_chunk_ms=0.1, speed=a.live_speed, num_gpu_blocks=4096)  # fmt: skip
    # every reuse is a global-tier fetch (turns go to other instances): the connector reuse the
    # router could not predict is the global tier's
    feed = PriceFeed(unpredicted="global")
    per_tok_true = (prof.kv_bytes_per_token / (a.live_gbps * 1e9) + 0.1e-3 / LMCACHE_CHUNK_TOKENS) * 1e6
    rng = random.Random(7)
    sessions: list[list[int]] = []
    used: list[set[int]] = []  # instances each session's turns ran on
    trace: list[tuple[int, float, float]] = []  # (done, the TTFT fit's fetch price, the retrieve fit's)
    done = 0
    slow_from: int | None = None
    flight, queued = [0] * n_inst, [0] * n_inst
    async with running_mocks(args) as mocks, aiohttp.ClientSession() as s:
        urls = [m.http_url for m, _ in mocks]
        # the controller's engine-metrics poller, at the bench's poll period: LMCache's retrieve
        # histogram on each engine feeds the price estimator (as controller/app.py wires it), its wall
        # seconds in the engines' model seconds like the TTFTs below
        def on_retrieve(iid: str, n: float, mean_s: float, tokens: float) -> None:
            feed.on_retrieve(iid, n, mean_s * a.live_speed, tokens)

        poller = EngineMetricsPoller({f"mock-{i}": u for i, u in enumerate(urls)}, LoadTracker(),
                                     interval_s=a.live_poll_s, on_retrieve=on_retrieve)
        polling = asyncio.create_task(poller.run())

        async def one(k: int) -> None:
            nonlocal done
            # a new session (a fresh prefix) or the next turn of an earlier one, on an instance none of
            # its turns ran on (so none holds it on its GPU: the reuse is a global-tier fetch)
            open_ = [i for i, u in enumerate(used) if len(u) < n_inst]
            if not open_ or rng.random() < 0.35:
                sessions.append([rng.randrange(1, 30000) for _ in range(rng.randrange(512, 6144))])
                used.append(set())
                sid, turn = len(sessions) - 1, 0
            else:
                sid = rng.choice(open_)
                sessions[sid] = sessions[sid] + [rng.randrange(1, 30000) for _ in range(rng.randrange(64, 1024))]
                turn = 1
            prompt = sessions[sid]
            iid = rng.choice([i for i in range(n_inst) if i not in used[sid]])
            used[sid].add(iid)
            rid = f"r{k}"
            # the queue it joins, as the controller's load tracker would count it
            feed.on_routed(rid, f"mock-{iid}", len(prompt), 0, 0, float(queued[iid]), float(flight[iid]))
            flight[iid] += 1
            queued[iid] += len(prompt)
            t0 = time.perf_counter()
            async with s.post(f"{urls[iid]}/v1/completions",
                              json={"model": "tiny", "prompt": prompt, "max_tokens": 1}) as r:
                body = await r.json()
            ttft = time.perf_counter() - t0
            flight[iid] -= 1
            queued[iid] -= len(prompt)
            cached = body.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")
            # wall seconds x speed = the engines' model seconds, the unit the true price is in
            feed.on_done(rid, ttft_s=ttft * a.live_speed, cached_tokens=cached, prompt_tokens=len(prompt))
            if a.debug and k % 20 == 0:
                log(f"debug L={len(prompt)} cached={cached} ttft_model_s={ttft * a.live_speed:.3f} turn={turn}")
            done += 1
            if turn:
                retrieve = feed.book.pooled.retrieve_prices()
                trace.append((done, feed.book.pooled.prices().fetch_global_us,
                              retrieve["fetch_global_us"] if retrieve else float("nan")))

        total = a.requests + a.requests // 2
        k = 0
        t_start = time.monotonic()
        while k < total:
            if slow_from is None and k >= a.requests:
                async with s.post(f"{urls[0]}/mock/retrieve", json={"scale": 4}) as r:
                    assert r.status == 200, await r.text()
                slow_from = done
            batch = min(a.live_concurrency, total - k)
            await asyncio.gather(*(one(k + j) for j in range(batch)))
            k += batch
            if k % 250 < batch:
                log(f"[4] live: {k}/{total} requests, learned fetch {feed.book.pooled.prices().fetch_global_us:.2f} "
                    f"µs/token, retrieve {trace[-1][2] if trace else float('nan'):.2f} ({time.monotonic() - t_start:.0f} s)")
        await poller.close()
        await asyncio.gather(polling, return_exceptions=True)
    after_true = 4 * per_tok_true
    out: dict[str, Any] = {"live_fetch_true_us": round(per_tok_true, 2), "after_slowdown_true_us": round(after_true, 2),
                           "speed": a.live_speed, "retrieve_polls": feed.stats["retrieve_polls"]}
    # the TTFT fit's fetch price (what decisions use) and the retrieve fit's (LMCache's metrics)
    for col, tag in ((1, ""), (2, "_retrieve_fit")):
        before = [t[col] for t in trace if t[0] <= a.requests]
        learned = before[-1] if before else float("nan")
        # how soon each finds the price: the error after a quarter of the requests
        early = [t[col] for t in trace if t[0] <= a.requests // 4]
        follow = next((t[0] - (slow_from or 0) for t in trace
                       if t[0] > (slow_from or 0) and abs(t[col] / after_true - 1) <= 0.2), None)
        last = trace[-1][col] if trace else float("nan")
        out.update({f"live_fetch_learned_us{tag}": round(learned, 2),
                    f"live_fetch_price_rel_err{tag}": round(abs(learned / per_tok_true - 1), 4),
                    f"live_fetch_rel_err_at_quarter{tag}": round(abs(early[-1] / per_tok_true - 1), 4) if early else None,
                    f"after_slowdown_learned_us{tag}": round(last, 2), f"requests_to_follow_slowdown{tag}": follow})
        log(f"[4] live{tag.replace('_', ' ') or ' TTFT fit'}: fetch {learned:.2f} µs/token "
            f"learned vs {per_tok_true:.2f} true after {a.requests} requests "
            f"({out[f'live_fetch_rel_err_at_quarter{tag}']} off after {a.requests // 4}); after the 4x slowdown "
            f"{last:.2f} vs {after_true:.2f} (within 20% after {follow} requests)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer cells and requests (a few minutes)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--parts", default="1,2,3,4", help="comma list of the parts to run")
    ap.add_argument("--requests", type=int, default=2000, help="done reports before the learned prices are read")
    ap.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--axis", dest="axis_arg", default="", help="part 3's per-request fetch speeds, GB/s (comma list)")
    ap.add_argument("--tiers", dest="tiers_arg", default="", help="part 3's global-tier provisioning (comma list)")
    # Seed 0 and two never developed on (1 and 2 were): one knee search on one seed moves a cell by
    # 10-20% with the luck of one run near the SLO cliff (docs/prices.md), the mean of three less.
    ap.add_argument("--seeds", default="0,3,4", help="part 3's arrival seeds (comma list; a cell's score is "
                    "each policy's mean over them)")
    ap.add_argument("--map-instances", type=int, default=0, help="part 3's instances (default 4 quick, 8)")
    ap.add_argument("--show-loads", action="store_true",
                    help="part 3: print every policy's TPS within SLO at every load of its knee search")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a smetric_ect parameter")
    a = ap.parse_args()
    q = a.quick
    a.instances, a.rate, a.window = 4, 0.15, 3000.0  # 0.15 sessions/s: near the knee of 4 instances
    a.sim_gbs, a.adapt_gbs = 1.6, 6.64
    a.adapt_instances, a.adapt_rate, a.adapt_w = 8, 0.25, 120.0  # near the slow path's knee
    a.adapt_seeds = (1, 2, 3) if q else (1, 2, 3, 4, 5)
    a.axis = (0.8, 6.64) if q else (0.8, 1.6, 6.64, 25.0)
    a.tiers = ("full",) if q else ("0.4", "full")
    a.x, a.map_roots = 0.3, 150 if q else 300
    a.map_instances = a.map_instances or (4 if q else 8)
    a.map_window = 600.0 if q else 1200.0
    a.pilots, a.rate_factors = (1, (0.8, 1.0, 1.25)) if q else (2, (0.6, 0.8, 1.0, 1.25, 1.6))
    a.live_gbps, a.live_speed, a.live_concurrency = 1.6, 4.0, 8
    a.live_poll_s = 1.0  # the engine-metrics poll (the live-peers bench's; the controller's default is 2 s)
    if a.axis_arg:
        a.axis = tuple(float(v) for v in a.axis_arg.split(","))
    if a.tiers_arg:
        a.tiers = tuple(a.tiers_arg.split(","))
    a.map_seeds = tuple(int(v) for v in a.seeds.split(","))
    a.params = {k: float(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    parts = {int(p) for p in a.parts.split(",")}
    prof = load_profile(PROFILE)
    cpu0 = cpu_times()
    t0 = time.monotonic()
    res: dict[str, Any] = {}
    if 1 in parts:
        res["sim"] = sim_accuracy(a, prof)
    if 2 in parts:
        res["adapt"] = adapt(a, prof)
    if 3 in parts:
        res["axis"] = fetch_axis(a, prof)
    if 4 in parts:
        res["live"] = asyncio.run(_live(a, prof))
    cells = res.get("axis", {}).get("cells", [])

    def mn(k: str) -> float | None:
        v = [c[k] for c in cells if c[k] == c[k]]
        return round(min(v), 4) if v else None

    line = {
        "fetch_price_rel_err": res.get("sim", {}).get("fetch_price_rel_err"),
        "prefill_price_rel_err": res.get("sim", {}).get("prefill_price_rel_err"),
        "live_fetch_price_rel_err": res.get("live", {}).get("live_fetch_price_rel_err"),
        "adapt_s": res.get("adapt", {}).get("adapt_s"),
        "variant_vs_best_min_over_fetch_axis": mn("vs_best"),
        "variant_vs_lmetric_min_over_fetch_axis": mn("vs_lmetric"),
        "variant_learned_vs_fixed_min": mn("vs_fixed"),
        "variant_knobs_tuned_on_eval": 0,
        # cells below the best baseline, and of those the ones whose 90% interval over the seeds lies
        # wholly below 1.0 (a loss the seeds' spread does not explain)
        "variant_cells_below_best": sum(c["vs_best"] < 1 for c in cells) if cells else None,
        "variant_cells_below_best_beyond_noise": sum(c["vs_best_ci90"][1] < 1 for c in cells) if cells else None,
        "variant_cells_below_fixed_beyond_noise": sum(c["vs_fixed_ci90"][1] < 1 for c in cells) if cells else None,
    }
    log(f"wall {time.monotonic() - t0:.0f} s; machine CPU steal during the run {steal_since(cpu0)}; quick={q}")
    log("detail " + json.dumps(res, default=str))
    print(json.dumps(line))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
