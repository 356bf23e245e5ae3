"""``smetric sim validate``: the simulator against real vLLM engines on this machine.

Starts N vLLM CPU engines (tiny local model, every thread of engine i on core i) with the controller
and the gateway (the ``smetric up`` machinery) and profiles engine 0 idle (``calibrate``). Then per
policy: a calibration replay (caches cleared, ``load_balance``, another workload) fits how much
slower the engines run under the live stack and the request path under that load
(``fit_under_load``); then every prefix cache is cleared, the controller's policy switched (hot
reload), the validation workload replayed through the gateway and simulated with the fitted profile.
Live and simulated runs are compared on throughput (tokens over the run), TTFT p50, local-hit ratio,
stickiness and route-reason mix; the policies are ranked by throughput in both.

The simulator models the engines' iterations only. What a live request spends outside them (client,
gateway, controller, vLLM's API server and engine-core hand-offs: the *request path*) is ``pre``
(send to first token, beyond the first iteration) and ``post`` (last token to the end of the
stream). A closed-loop session waits ``pre + post`` between a reply and its next request's first
iteration, so the simulated sessions get it as think time; simulated TTFTs get ``pre`` added.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from smetric_lmc.replay.calibrate import Calibration, calibrate
from smetric_lmc.replay.compare import reason_shares, simulate_like, warm_up, write_profile
from smetric_lmc.replay.prompts import scale_workload
from smetric_lmc.replay.runner import ReplayConfig, replay
from smetric_lmc.replay.summary import summarize_records
from smetric_lmc.sim.metrics import SimResult
from smetric_lmc.sim.profile import Profile
from smetric_lmc.workload.model import TraceSession, Workload

log = logging.getLogger(__name__)


@dataclass
class RequestPath:
    """The request path around the engine's iterations, measured (seconds)."""

    pre: float  # send -> first token, beyond the first iteration
    post: float  # last token -> end of the stream at the client

    @property
    def turnaround(self) -> float:
        return self.pre + self.post


@dataclass
class RealPoint:
    policy: str
    live: SimResult
    sim: SimResult
    path: RequestPath
    conditions: dict[str, Any] = dataclasses.field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        ls, ss = self.live.summary, self.sim.summary
        return {"policy": self.policy, "tput_live": run_tps(self.live),
                "tput_sim": run_tps(self.sim, tail_s=self.path.post),
                "ttft_p50_live": ls["ttft_p50"], "ttft_p50_sim": ss["ttft_p50"] + self.path.pre,
                "path_pre_s": self.path.pre, "path_post_s": self.path.post, **self.conditions,
                "hit_live": ls["hit_local"], "hit_sim": ss["hit_local"],
                "sticky_live": ls["stickiness"], "sticky_sim": ss["stickiness"],
                "reasons_live": reason_shares(ls), "reasons_sim": reason_shares(ss)}


def run_tps(res: SimResult, tail_s: float = 0.0) -> float:
    """Input + output tokens of served requests over first arrival .. last finish (both runs alike;
    ``tail_s``: time from the last token to the client that the run does not model)."""
    c = res.cols
    ok = ~c["rejected"].astype(bool)
    if not ok.any():
        return 0.0
    dur = float(np.nanmax(c["finish"][ok]) - np.nanmin(c["arrival"][ok])) + tail_s
    return float((c["input"][ok] + c["output"][ok]).sum() / max(dur, 1e-9))


def small_workload(sessions: int, turns: int, context_scale: float, output_scale: float, seed: int = 0) -> Workload:
    """Synthetic agent sessions cut to ``turns`` requests, scaled to fit a CPU engine."""
    from smetric_lmc.workload import synthetic

    wl = synthetic(sessions, seed=seed)
    roots = [TraceSession(s.session_id, s.requests[:turns]) for s in wl.sessions if s.parent_id is None]
    return scale_workload(Workload(wl.name, wl.block_size, roots), context_scale, output_scale)


def with_turnaround(wl: Workload, seconds: float, max_think_s: float) -> Workload:
    """The workload as the simulator should see a closed-loop client whose next request reaches the
    engine ``seconds`` after the previous reply left it: think times (clipped as the replay clips
    them) plus the request path."""
    def session(s: TraceSession) -> TraceSession:
        return dataclasses.replace(s, requests=[
            dataclasses.replace(r, think_time=min(max(0.0, r.think_time), max_think_s) + (seconds if k else 0.0))
            for k, r in enumerate(s.requests)])

    return dataclasses.replace(wl, sessions=[session(s) for s in wl.sessions])


def decode_s_per_token(res: SimResult) -> float:
    """Time from first to last token over the tokens after the first, served requests pooled."""
    c = res.cols
    ok = ~c["rejected"].astype(bool) & (c["output"] > 1)
    steps = float((c["output"][ok] - 1).sum())
    return float((c["finish"][ok] - c["first_token"][ok]).sum()) / steps if steps else float("nan")


def slowed(profile: Profile, factor: float) -> Profile:
    """Every iteration ``factor`` times longer (compute, memory and overhead alike)."""
    return profile.with_overrides(peak_flops=profile.peak_flops / factor, hbm_bw=profile.hbm_bw / factor,
                                  iter_overhead_s=profile.iter_overhead_s * factor)


@dataclass
class LoadedFit:
    """The profile and request path as a calibration replay saw them (see ``fit_under_load``)."""

    profile: Profile
    slowdown: float  # engine iterations during the replay / on the idle engine (calibration probes)
    pre: float  # request path before the first token, under the replay's concurrency (s)
    live: SimResult
    sim: SimResult


def fit_under_load(cal_wl: Workload, live: SimResult, profile: Profile, path: RequestPath, policy: str,
                   engines: int, rate: float, seed: int, max_think_s: float, rounds: int = 3) -> LoadedFit:
    """Fit two numbers on a calibration replay (another workload, replayed like the validation's):
    how much slower the engines' iterations run while the whole stack shares the machine (decode
    time per token, live over simulated) and the request path before the first token under that
    concurrency (live TTFT p50 minus the simulated engine's). The idle-engine probes miss both: on a
    CPU the API servers, gateway, controller and client take the cores the iterations run on.

    Well posed where a decode step is mostly fixed cost (this CPU engine: the fit recovers a known
    slowdown within a few percent); where long prefill chunks share steps with decodes (a large
    model), decode time per token jumps with which requests overlap and the fit is ill posed."""
    d_live = decode_s_per_token(live)
    ttft_live = float(live.summary["ttft_p50"])
    if not (np.isfinite(d_live) and np.isfinite(ttft_live)):
        # A served request without a first-token time would make the fit chase NaN to its bracket's end.
        raise ValueError(f"calibration replay has no decode time or TTFT to fit (decode {d_live}, TTFT p50 "
                         f"{ttft_live}): a served request lacks a first-token time")

    def run(factor: float, pre: float) -> SimResult:
        return simulate_like(with_turnaround(cal_wl, pre + path.post, max_think_s), slowed(profile, factor), policy,
                             engines, rate, seed, 1e9)

    factor, pre = 1.0, path.pre
    for _ in range(rounds):
        # Bisection on a log scale: decode time per token grows with the factor, but in steps (which
        # decodes share an iteration with a prefill changes), so a fixed-point iteration oscillates.
        lo, hi = np.log(1 / 16), np.log(64.0)
        for _ in range(16):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if decode_s_per_token(run(float(np.exp(mid)), pre)) < d_live else (lo, mid)
        factor = float(np.exp((lo + hi) / 2))
        pre = max(0.0, ttft_live - float(run(factor, pre).summary["ttft_p50"]))
    return LoadedFit(slowed(profile, factor), factor, pre, live, run(factor, pre))


def measure_path(gateway: str, cal: Calibration, n: int = 9) -> RequestPath:
    """Medians over tiny requests (32 tokens, 1 output) through the gateway, one at a time."""
    import asyncio

    from smetric_lmc.replay.calibrate import _Prober

    async def run() -> list[Any]:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            pr = _Prober(http, gateway, "tiny", 4096, seed=int(time.time()))
            return [await pr.timed(pr.tokens(32), 1) for _ in range(n)]

    timings = asyncio.run(run())
    first = float(np.median([t.first for t in timings]))
    post = float(np.median([t.end - t.first for t in timings]))
    return RequestPath(max(0.0, first - cal.profile.iteration_time([(32, 0)], 0, 0)), post)


def _group_pids(pgid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def pin_engines(engines: list[Any]) -> dict[str, int]:
    """Every thread of engine i (API server, engine core, worker) onto core i, the core its OpenMP
    threads are already bound to. vLLM's worker busy-polls its shared-memory queue for a second after
    each step, so an engine with work holds a whole core: unpinned, two busy engines' workers leave
    no core for either engine's API server and engine core, and each engine's speed depends on what
    the other is doing, which the simulator (independent accelerators) cannot know. Pinned, an engine
    runs during the replay as it ran when it was calibrated alone."""
    cores = sorted(os.sched_getaffinity(0))
    placed = {}
    for i, e in enumerate(engines):
        core = cores[i % len(cores)]
        for pid in _group_pids(e.process.pid):
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    os.sched_setaffinity(int(task.name), {core})
                except OSError:
                    continue  # a thread that ended meanwhile
        placed[e.instance_id] = core
    return placed


def _cpu_seconds(pgids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system) of each process group so far, and of this process (the client)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(pgids, 0.0)
    by_pgid = {v: k for k, v in pgids.items()}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            f = stat.read_text().rsplit(")", 1)[1].split()
            name = by_pgid.get(int(f[2]))
            if name is not None:
                out[name] += (int(f[11]) + int(f[12])) / tick
        except (OSError, IndexError, ValueError):
            continue  # gone while we looked
    t = os.times()
    out["client"] = t.user + t.system
    return out


def _reset_caches(engines: list[Any]) -> None:
    """Empty every engine's prefix cache, and make sure the controller has heard about it: vLLM queues
    ``AllBlocksCleared`` and publishes it with its next step, so an idle engine is given one tiny
    request (shorter than a block: it stores nothing)."""
    for e in engines:
        _post(f"{e.http_url}/reset_prefix_cache")
    for e in engines:
        body = json.dumps({"model": e.model, "prompt": [5, 6, 7], "max_tokens": 1}).encode()
        req = urllib.request.Request(f"{e.http_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
    time.sleep(1.0)  # the batch reaches the controller's subscriber


def real_available() -> str | None:
    """Why the real-engine validation cannot run here (None: it can)."""
    from smetric_lmc.workers import launch

    py = launch.engine_python()
    if not py.exists():
        return f"no vLLM engine venv at {launch.engine_venv_dir()} (bash .ci/engine-venv.sh builds it)"
    return None


def _post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=30) as r:
        r.read()


def _set_policy(config_path: Path, data: dict[str, Any], policy: str, route_url: str) -> None:
    from smetric_lmc.client import RouteClient
    from smetric_lmc.workers import up

    data["policy"]["name"] = policy
    up.write_config(data, config_path)
    with RouteClient(route_url) as c:
        deadline = time.monotonic() + 30
        while c.stats()["policy"]["name"] != policy:
            if time.monotonic() > deadline:
                raise RuntimeError(f"controller did not switch to policy {policy}")
            time.sleep(0.2)


# round_robin, not cache_first: the sessions share a system prompt, so on 2 engines cache_first sends
# every session to the engine that cached it first, which on a CPU box frees the other core for the
# request path, an effect no accelerator cluster has (docs/validation.md).
DEFAULT_POLICIES = ("smetric", "load_balance", "round_robin")
CALIBRATION_POLICY = "load_balance"  # spreads sessions over every engine, as most policies do


def validate_real(work: Path, *, engines: int = 2, policies: tuple[str, ...] = DEFAULT_POLICIES,
                  sessions: int = 16, turns: int = 8, context_scale: float = 0.04, output_scale: float = 0.03,
                  rate: float = 4.0, max_think_s: float = 0.0, seed: int = 0, pin: bool = True,
                  max_model_len: int = 4096, num_gpu_blocks: int | None = 320) -> dict[str, Any]:
    """Run the validation; prints the side-by-side tables and returns the bench's JSON fields.

    The default workload: closed loop without think time, short outputs, sessions starting at ``rate``
    per second; a session's turns follow each other as fast as the engines and the request path allow.
    The default engines hold ``num_gpu_blocks`` blocks of 32 tokens (vLLM's
    ``--num-gpu-blocks-override``; the calibration reads it back from ``/metrics``), so a policy that
    spreads a session's turns over both engines stores its context twice and evicts, and contexts up
    to ``max_model_len`` make the prefill it then repeats cost more than the request path."""
    from smetric_lmc.workers import launch, up

    work.mkdir(parents=True, exist_ok=True)
    venv = launch.find_engine_venv()
    python = launch.engine_python(venv)
    model = launch.build_tiny_model(venv.parent / "models" / "tiny-qwen2", python=python)
    specs = launch.cpu_test_specs(engines, model, python=python, block_size=32, num_gpu_blocks=num_gpu_blocks,
                                  max_model_len=max_model_len)
    print(f"starting {engines} vLLM CPU engines (about a minute)...", flush=True)
    running = launch.start_engines(specs, work, timeout_s=600)
    procs: list[launch.ProcessGroup] = []
    try:
        if pin:
            print(f"engines pinned to cores (every thread): {pin_engines(running)}", flush=True)
        cal: Calibration = calibrate(running[0].http_url, work / "calibrated.yaml", model_dir=model,
                                     engine_log=running[0].process.log_path)
        print(cal.report())
        route_port, metrics_port = launch.free_ports(2)
        route_url = f"tcp://127.0.0.1:{route_port}"
        data = up.controller_config(running, route_url=route_url, metrics_port=metrics_port, policy=policies[0])
        config_path = up.write_config(data, work / "smetric.yaml")
        procs.append(up.start_controller(config_path, metrics_port, work))
        gw_port = launch.free_ports(1)[0]
        procs.append(up.start_gateway(config_path, gw_port, work))
        gateway = f"http://127.0.0.1:{gw_port}"
        warm_up(gateway, route_url)
        wl = small_workload(sessions, turns, context_scale, output_scale, seed)
        pgids = {e.instance_id: e.process.pid for e in running} | {"controller": procs[0].pid, "gateway": procs[1].pid}
        cal_wl = small_workload(sessions, turns, context_scale, output_scale, seed + 1)
        points: list[RealPoint] = []
        cal_tps: list[float] = []  # the calibration replays: same workload, policy and knobs each time
        for pol in policies:
            # Calibration replay just before (the machine's load drifts within a minute): another
            # workload (other sessions, other placement), the same knobs, a neutral policy.
            _set_policy(config_path, data, CALIBRATION_POLICY, route_url)
            _reset_caches(running)
            idle = measure_path(gateway, cal)
            cal_records = replay(cal_wl, ReplayConfig(url=gateway, rate=rate, max_think_s=max_think_s, seed=seed + 1,
                                                      records=work / f"calibration-before-{pol}.jsonl"))
            loaded = fit_under_load(cal_wl, summarize_records(cal_records, policy=CALIBRATION_POLICY), cal.profile,
                                    idle, CALIBRATION_POLICY, engines, rate, seed + 1, max_think_s)
            write_profile(loaded.profile, work / f"calibrated-under-load-{pol}.yaml")
            cal_tps.append(run_tps(loaded.live))
            path = RequestPath(loaded.pre, idle.post)
            print(f"{pol}: calibration replay: decode {decode_s_per_token(loaded.live) * 1e3:.2f} ms/token live "
                  f"({decode_s_per_token(loaded.sim) * 1e3:.2f} simulated with the fit): engine iterations "
                  f"{loaded.slowdown:.2f}x the idle probes'; request path before the first token "
                  f"{loaded.pre * 1e3:.1f} ms ({idle.pre * 1e3:.1f} ms idle), {idle.post * 1e3:.1f} ms after the last",
                  flush=True)
            _set_policy(config_path, data, pol, route_url)
            _reset_caches(running)
            cpu0, load0, t0 = _cpu_seconds(pgids), os.getloadavg()[0], time.monotonic()
            records = replay(wl, ReplayConfig(url=gateway, rate=rate, max_think_s=max_think_s, seed=seed,
                                              records=work / f"{pol}.jsonl"))
            wall = time.monotonic() - t0
            cpu = {k: round(v - cpu0[k], 2) for k, v in _cpu_seconds(pgids).items()}
            live = summarize_records(records, policy=pol)
            sim = simulate_like(with_turnaround(wl, path.turnaround, max_think_s), loaded.profile, pol, engines,
                                rate, seed, 1e9)
            cond = {"idle_path_pre_s": idle.pre, "slowdown": loaded.slowdown, "replay_wall_s": round(wall, 2),
                    "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "cpu_s": cpu}
            points.append(RealPoint(pol, live, sim, path, cond))
            print(f"{pol}: live {run_tps(live):.0f} tok/s, sim {run_tps(sim, path.post):.0f} tok/s; "
                  f"{live.summary['failed']} failed; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; "
                  f"CPU seconds over {wall:.1f} s: {cpu}", flush=True)
    finally:
        for p in reversed(procs):
            p.stop(timeout_s=10.0)
        for e in running:
            e.process.stop()
    rows = [p.row() for p in points]
    (work / "validation.json").write_text(json.dumps(rows, default=float, indent=1))
    print(table(rows))
    print(conditions_table(rows))
    rank_live = [r["policy"] for r in sorted(rows, key=lambda r: -r["tput_live"])]
    rank_sim = [r["policy"] for r in sorted(rows, key=lambda r: -r["tput_sim"])]
    print(f"ranking by throughput: live {rank_live}, sim {rank_sim}")
    noise = spread(cal_tps)
    print(f"calibration replays (same workload and policy before each policy): "
          f"{', '.join(f'{t:.0f}' for t in cal_tps)} tok/s live")
    print(pairs_table(rank_pairs(rows, noise), noise))
    return {
        "engines": engines,
        "policies": list(policies),
        "hit_abs_err_max": round(max(abs(r["hit_live"] - r["hit_sim"]) for r in rows), 4),
        "tput_rel_err_max": round(max(abs(r["tput_sim"] / r["tput_live"] - 1) for r in rows), 4),
        "ttft_p50_rel_err_max": round(max(abs(r["ttft_p50_sim"] / r["ttft_p50_live"] - 1) for r in rows), 4),
        **rank_fields(rows, noise),
    }


def spread(values: list[float]) -> float:
    """Run-to-run noise of repeated replays: (max - min) / median; 0 with fewer than two."""
    if len(values) < 2:
        return 0.0
    return float((max(values) - min(values)) / np.median(values))


@dataclass
class PairVerdict:
    a: str
    b: str
    live_rel: float  # (tput a - tput b) / mean of the two, live
    sim_rel: float  # the same, simulated
    verdict: str  # "agree", "disagree", or "tie" (live difference within the noise: not judged)


def rank_pairs(rows: list[dict[str, Any]], noise: float) -> list[PairVerdict]:
    """Every pair of policies ordered by throughput, live and simulated. A pair whose live difference
    is within ``noise`` (the measured run-to-run spread) is a tie: its live order is chance, so
    neither order of the simulated pair is wrong. ``noise`` 0 judges plain ordering."""
    out = []
    for i, ra in enumerate(rows):
        for rb in rows[i + 1:]:
            live = (ra["tput_live"] - rb["tput_live"]) / ((ra["tput_live"] + rb["tput_live"]) / 2)
            sim = (ra["tput_sim"] - rb["tput_sim"]) / ((ra["tput_sim"] + rb["tput_sim"]) / 2)
            verdict = "tie" if abs(live) <= noise else "agree" if live * sim > 0 else "disagree"
            out.append(PairVerdict(ra["policy"], rb["policy"], live, sim, verdict))
    return out


def rank_fields(rows: list[dict[str, Any]], noise: float) -> dict[str, Any]:
    """The bench's ranking fields: agreement holds when every pair separated by more than the noise
    is ordered alike; with no separated pair at all there is nothing to agree on (False)."""
    pairs = rank_pairs(rows, noise)
    judged = [p for p in pairs if p.verdict != "tie"]
    return {"rank_agree": bool(judged) and all(p.verdict == "agree" for p in judged),
            "rank_noise_rel": round(noise, 4), "rank_pairs_separated": len(judged),
            "rank_ties": [f"{p.a}~{p.b}" for p in pairs if p.verdict == "tie"]}


def pairs_table(pairs: list[PairVerdict], noise: float) -> str:
    lines = [f"throughput differences per pair (noise: calibration replays spread {noise:.1%})",
             "| pair | live | sim | verdict |", "|---|---|---|---|"]
    lines += [f"| {p.a} vs {p.b} | {p.live_rel:+.1%} | {p.sim_rel:+.1%} | {p.verdict} |" for p in pairs]
    return "\n".join(lines) + "\n"


def table(rows: list[dict[str, Any]]) -> str:
    head = ["policy", "tok/s live", "sim", "TTFT p50 live", "sim", "local hit live", "sim", "sticky live", "sim"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['tput_live']:.0f} | {r['tput_sim']:.0f} | {r['ttft_p50_live']:.3f} | "
                     f"{r['ttft_p50_sim']:.3f} | {r['hit_live']:.3f} | {r['hit_sim']:.3f} | "
                     f"{r['sticky_live']:.3f} | {r['sticky_sim']:.3f} |")
    return "\n".join(lines) + "\n"


def conditions_table(rows: list[dict[str, Any]]) -> str:
    """What each replay ran under: the fitted engine slowdown and request path (calibration replay), the
    idle path, the machine's load, who used the CPU."""
    names = sorted({k for r in rows for k in r["cpu_s"]})
    head = ["policy", "slowdown", "path pre (ms)", "idle", "post (ms)", "load avg 1m (start, end)", "replay wall (s)",
            *(f"CPU s {n}" for n in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        la = r["load_avg_1m"]
        lines.append(f"| {r['policy']} | {r['slowdown']:.2f} | {r['path_pre_s'] * 1e3:.1f} | "
                     f"{r['idle_path_pre_s'] * 1e3:.1f} | {r['path_post_s'] * 1e3:.1f} | "
                     f"{la[0]:.1f}, {la[1]:.1f} | {r['replay_wall_s']:.1f} | "
                     + " | ".join(f"{r['cpu_s'].get(n, 0.0):.2f}" for n in names) + " |")
    return "\n".join(lines) + "\n"
