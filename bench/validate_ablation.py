"""What each part of the real-engine model contributes, recomputed from a validation's outputs.

    python bench/validate_ablation.py WORKDIR/real     # the folder `smetric sim validate --out` wrote

For every replay (policy and repeat), the live records against simulations of the same workload:
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
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from smetric_lmc.lab.replay.compare import simulate_like, simulate_per_instance, with_kv_tokens
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


def main(work: Path) -> None:
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


if __name__ == "__main__":
    main(Path(sys.argv[1]))
