"""``smetric sim validate``: the simulator against real vLLM engines on this machine.

Starts N vLLM CPU engines (tiny local model, every thread of engine i on core i) with the controller
and the gateway (the ``smetric up`` machinery) and profiles engine 0 idle (``calibrate``). Then each
policy is replayed ``repeats`` times in a balanced order (ABC CBA ABC: ``ranking.run_order``), and
every replay sits between two calibration replays (caches cleared, ``load_balance``, another
workload) that fit how much slower the engines run under the live stack and the request path under
that load (``fit_under_load``, ``fit_contention``). Before a replay every prefix cache is cleared and
the controller's policy switched (hot reload); the validation workload is replayed through the
gateway and simulated with what its two calibrations saw (``bracketed``). Live and simulated runs
are compared on throughput (tokens over the run), TTFT p50, local-hit ratio, stickiness and
route-reason mix, per replay and as medians over the repeats; the policies are ranked by throughput
(``ranking``).

The simulator models the engines' iterations only. What a live request spends outside them (client,
gateway, controller, vLLM's API server and engine-core hand-offs: the *request path*) is ``pre``
(send to first token, beyond the first iteration) and ``post`` (last token to the end of the
stream). A closed-loop session waits ``pre + post`` between a reply and its next request's first
iteration, so the simulated sessions get it as think time; simulated TTFTs get the path at the
simulated concurrency added (``Contention``: it grows with the requests in flight on the engine).
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

from smetric_lmc.lab.replay.calibrate import Calibration, calibrate
from smetric_lmc.lab.replay.compare import (
    reason_shares,
    simulate_like,
    simulate_per_instance,
    warm_up,
    write_profile,
)
from smetric_lmc.lab.replay.prompts import scale_workload
from smetric_lmc.lab.replay.ranking import pairs_table, rank_fields, rank_pairs, run_order, spread
from smetric_lmc.lab.replay.runner import ReplayConfig, replay
from smetric_lmc.lab.replay.schedstat import EngineCpu, measured_slowdowns
from smetric_lmc.lab.replay.summary import summarize_records
from smetric_lmc.lab.replay.under_load import (
    Contention,
    LoadedFit,
    RequestPath,
    bracketed,
    decode_s_per_token,
    fit_under_load,
    run_tps,
    slowed,
    with_turnaround,
)
from smetric_lmc.lab.sim.metrics import SimResult
from smetric_lmc.lab.workload.model import TraceSession, Workload

log = logging.getLogger(__name__)


@dataclass
class RealPoint:
    policy: str
    repeat: int
    live: SimResult
    sim: SimResult
    path: RequestPath
    contention: Contention
    conditions: dict[str, Any] = dataclasses.field(default_factory=dict)
    sim_bracketed: SimResult | None = None  # the calibrations' mean speed for every engine (the earlier model)

    def row(self) -> dict[str, Any]:
        ls, ss = self.live.summary, self.sim.summary
        return {"policy": self.policy, "repeat": self.repeat, "tput_live": run_tps(self.live),
                "tput_sim": run_tps(self.sim, tail_s=self.path.post),
                "ttft_p50_live": ls["ttft_p50"], "ttft_p50_sim": float(np.nanmedian(self.contention.ttft(self.sim))),
                "ttft_p50_sim_const": ss["ttft_p50"] + self.path.pre,
                **self._bracketed(),
                "path_pre_s": self.path.pre, "path_post_s": self.path.post,
                "path_base_s": self.contention.base, "path_per_inflight_s": self.contention.per_inflight,
                **self.conditions,
                "hit_live": ls["hit_local"], "hit_sim": ss["hit_local"],
                "sticky_live": ls["stickiness"], "sticky_sim": ss["stickiness"],
                "reasons_live": reason_shares(ls), "reasons_sim": reason_shares(ss)}


    def _bracketed(self) -> dict[str, Any]:
        b = self.sim_bracketed or self.sim
        return {"tput_sim_bracketed": run_tps(b, tail_s=self.path.post),
                "ttft_p50_sim_bracketed": float(np.nanmedian(self.contention.ttft(b))),
                "hit_sim_bracketed": b.summary["hit_local"]}


def small_workload(sessions: int, turns: int, context_scale: float, output_scale: float, seed: int = 0) -> Workload:
    """Synthetic agent sessions cut to ``turns`` requests, scaled to fit a CPU engine."""
    from smetric_lmc.lab.workload import synthetic

    wl = synthetic(sessions, seed=seed)
    roots = [TraceSession(s.session_id, s.requests[:turns]) for s in wl.sessions if s.parent_id is None]
    return scale_workload(Workload(wl.name, wl.block_size, roots), context_scale, output_scale)


def measure_path(gateway: str, cal: Calibration, n: int = 9) -> RequestPath:
    """Medians over tiny requests (32 tokens, 1 output) through the gateway, one at a time."""
    import asyncio

    from smetric_lmc.lab.replay.calibrate import _Prober

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


def _reset_caches(engines: list[Any], timeout_s: float = 30.0) -> None:
    """Empty every engine's prefix cache, and make sure the controller has heard about it. vLLM refuses
    (``success: false``) while a request still holds blocks (one the previous replay's client gave up
    on), so it is retried until the engine is idle. vLLM queues ``AllBlocksCleared`` and publishes it
    with its next step, so an idle engine is then given one tiny request (shorter than a block: it
    stores nothing)."""
    for e in engines:
        deadline = time.monotonic() + timeout_s
        while not json.loads(_post(f"{e.http_url}/reset_prefix_cache") or b"{}").get("success", False):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{e.http_url} refused to reset its prefix cache for {timeout_s:.0f} s")
            time.sleep(0.2)
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


def _post(url: str) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=30) as r:
        return r.read()


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
# Which run share scales an engine's speed (``schedstat.EngineCpu.since``): every thread's. It cut the
# mean throughput and TTFT p50 errors of a drifting run (calibrations 31% apart) from 10.5% and 27.6%
# to 5.9% and 13.9%; on a steady run (4%) the worker's share and every thread's did about alike
# (docs/validation.md, runs 3 and 4).
SPEED_SIGNAL = "run_share_all"
CALIBRATION_POLICY = "load_balance"  # spreads sessions over every engine, as most policies do


def validate_real(work: Path, *, engines: int = 2, policies: tuple[str, ...] = DEFAULT_POLICIES,
                  sessions: int = 16, turns: int = 8, context_scale: float = 0.04, output_scale: float = 0.03,
                  rate: float = 4.0, max_think_s: float = 0.0, seed: int = 0, pin: bool = True,
                  max_model_len: int = 4096, num_gpu_blocks: int | None = 320, repeats: int = 3) -> dict[str, Any]:
    """Run the validation; prints the side-by-side tables and returns the bench's JSON fields.

    The default workload: closed loop without think time, short outputs, sessions starting at ``rate``
    per second; a session's turns follow each other as fast as the engines and the request path allow.
    The default engines hold ``num_gpu_blocks`` blocks of 32 tokens (vLLM's
    ``--num-gpu-blocks-override``; the calibration reads it back from ``/metrics``), so a policy that
    spreads a session's turns over both engines stores its context twice and evicts, and contexts up
    to ``max_model_len`` make the prefill it then repeats cost more than the request path.

    Every policy runs ``repeats`` times in a balanced order (``ranking.run_order``: forward, then
    reversed, ...), every replay between two calibration replays and simulated with what they saw
    (``bracketed``)."""
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
        slot = _Slot(running, gateway, config_path, data, route_url, cal, pgids, work, wl, cal_wl,
                     dict(engines=engines, rate=rate, max_think_s=max_think_s, seed=seed))
        order = run_order(policies, repeats)
        fits: list[tuple[LoadedFit, RequestPath]] = []  # the calibration replays, one before every replay and one after
        lives: list[tuple[SimResult, dict[str, Any]]] = []
        tags = calibration_tags(len(order))
        for k, (pol, rep) in enumerate(order):
            fits.append(slot.calibrate(tags[k]))
            lives.append(slot.replay(pol, rep))
        fits.append(slot.calibrate(tags[-1]))
    finally:
        for p in reversed(procs):
            p.stop(timeout_s=10.0)
        for e in running:
            e.process.stop()
    points = [slot.simulate(pol, rep, lives[k], fits[k], fits[k + 1]) for k, (pol, rep) in enumerate(order)]
    cal_tps = [run_tps(f.live) for f, _ in fits]
    slots = [p.row() for p in points]
    (work / "validation.json").write_text(json.dumps(slots, default=float, indent=1))
    print("every replay, in run order:")
    print(table(slots))
    print(conditions_table(slots))
    print(f"calibration replays (the same workload and policy before, between and after the replays): "
          f"{', '.join(f'{t:.0f}' for t in cal_tps)} tok/s live (spread {spread(cal_tps):.1%})")
    rows, fields = summarize_repeats(slots, list(policies))
    print(f"per policy, medians over {repeats} repeat(s):")
    print(table(rows))
    print(pairs_table(rank_pairs(rows)))
    return {"engines": engines, "policies": list(policies), **fields,
            "calibration_spread_rel": round(spread(cal_tps), 4)}


def summarize_repeats(slots: list[dict[str, Any]], policies: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-policy rows (medians over the policy's repeats, each repeat simulated with its own fit;
    ``noise``: the spread of its live throughputs) and the bench's fields: errors of the medians, the
    worst error of a single repeat (``*_repeat``), each policy's live throughputs per repeat, and the
    ranking (``ranking.rank_fields``)."""
    keys = ("tput_live", "tput_sim", "ttft_p50_live", "ttft_p50_sim", "ttft_p50_sim_const", "hit_live", "hit_sim",
            "sticky_live", "sticky_sim", "tput_sim_bracketed", "ttft_p50_sim_bracketed", "hit_sim_bracketed")
    rows, by_pol = [], {}
    for pol in policies:
        mine = [r for r in slots if r["policy"] == pol]
        if not mine:
            raise ValueError(f"no replay of policy {pol}")
        by_pol[pol] = [r["tput_live"] for r in mine]
        rows.append({"policy": pol, **{k: float(np.nanmedian([r[k] for r in mine])) for k in keys},
                     "noise": spread(by_pol[pol])})

    def err(rs: list[dict[str, Any]], sim: str, live: str) -> float:
        return round(max(abs(r[sim] / r[live] - 1) for r in rs), 4)

    return rows, {
        "repeats": max(len(v) for v in by_pol.values()),
        "hit_abs_err_max": round(max(abs(r["hit_live"] - r["hit_sim"]) for r in rows), 4),
        "tput_rel_err_max": err(rows, "tput_sim", "tput_live"),
        "ttft_p50_rel_err_max": err(rows, "ttft_p50_sim", "ttft_p50_live"),
        "tput_rel_err_max_repeat": err(slots, "tput_sim", "tput_live"),
        "ttft_p50_rel_err_max_repeat": err(slots, "ttft_p50_sim", "ttft_p50_live"),
        "ttft_p50_rel_err_max_const_path": err(rows, "ttft_p50_sim_const", "ttft_p50_live"),
        # the earlier model: every engine at the calibrations' mean speed, no measured run share
        "hit_abs_err_max_bracketed": round(max(abs(r["hit_live"] - r["hit_sim_bracketed"]) for r in rows), 4),
        "tput_rel_err_max_bracketed": err(rows, "tput_sim_bracketed", "tput_live"),
        "ttft_p50_rel_err_max_bracketed": err(rows, "ttft_p50_sim_bracketed", "ttft_p50_live"),
        "tput_live_by_repeat": {k: [round(x) for x in v] for k, v in by_pol.items()},
        **rank_fields(rows),
    }


def calibration_tags(replays: int) -> list[str]:
    """Names of the calibration replays around ``replays`` replays (``calibration-<tag>.jsonl``):
    replay k runs between tags[k] and tags[k + 1]."""
    return ["before-first", *(f"between-{k - 1}-{k}" for k in range(1, replays)), "after-last"]


class _Slot:
    """The steps of the validation. Every replay of a policy runs between two calibration replays
    (caches cleared, ``load_balance``, another workload), caches cleared before it too; it is then
    simulated with what the two calibrations saw (``bracketed``): live and simulated see the same
    engine state and the same seconds of the machine's load, and nothing is fitted on the replay."""

    def __init__(self, running: list[Any], gateway: str, config_path: Path, data: dict[str, Any], route_url: str,
                 cal: Calibration, pgids: dict[str, int], work: Path, wl: Workload, cal_wl: Workload,
                 knobs: dict[str, Any]) -> None:
        self.running, self.gateway, self.config_path, self.data = running, gateway, config_path, data
        self.route_url, self.cal, self.pgids, self.work, self.wl, self.cal_wl = route_url, cal, pgids, work, wl, cal_wl
        self.engine_pgids = {e.instance_id: e.process.pid for e in running}
        self.engines, self.rate = knobs["engines"], knobs["rate"]
        self.max_think_s, self.seed = knobs["max_think_s"], knobs["seed"]

    def calibrate(self, tag: str) -> tuple[LoadedFit, RequestPath]:
        _set_policy(self.config_path, self.data, CALIBRATION_POLICY, self.route_url)
        _reset_caches(self.running)
        idle = measure_path(self.gateway, self.cal)
        s0 = EngineCpu.sample(self.engine_pgids)
        cal_records = replay(self.cal_wl, ReplayConfig(url=self.gateway, rate=self.rate, max_think_s=self.max_think_s,
                                                       seed=self.seed + 1, records=self.work / f"calibration-{tag}.jsonl"))
        loaded = fit_under_load(self.cal_wl, summarize_records(cal_records, policy=CALIBRATION_POLICY),
                                self.cal.profile, idle, CALIBRATION_POLICY, self.engines, self.rate, self.seed + 1,
                                self.max_think_s)
        loaded.sched = EngineCpu.sample(self.engine_pgids).since(s0)
        loaded.run_share = loaded.sched[SPEED_SIGNAL]
        ct = loaded.contention
        print(f"calibration {tag}: {run_tps(loaded.live):.0f} tok/s; decode {decode_s_per_token(loaded.live) * 1e3:.2f} "
              f"ms/token live ({decode_s_per_token(loaded.sim) * 1e3:.2f} simulated with the fit): engine iterations "
              f"{loaded.slowdown:.2f}x the idle probes'; request path before the first token "
              f"{loaded.pre * 1e3:.1f} ms at the median ({ct.base * 1e3:.1f} ms + {ct.per_inflight * 1e3:.1f} ms per "
              f"request in flight on the engine; {idle.pre * 1e3:.1f} ms idle), {idle.post * 1e3:.1f} ms after the last; "
              f"run share {_fmt_shares(loaded.run_share)}",
              flush=True)
        return loaded, idle

    def replay(self, pol: str, rep: int) -> tuple[SimResult, dict[str, Any]]:
        tag = f"{pol}-r{rep}"
        _set_policy(self.config_path, self.data, pol, self.route_url)
        _reset_caches(self.running)
        cpu0, load0, t0 = _cpu_seconds(self.pgids), os.getloadavg()[0], time.monotonic()
        s0 = EngineCpu.sample(self.engine_pgids)
        records = replay(self.wl, ReplayConfig(url=self.gateway, rate=self.rate, max_think_s=self.max_think_s,
                                               seed=self.seed, records=self.work / f"{tag}.jsonl"))
        wall = time.monotonic() - t0
        sched = EngineCpu.sample(self.engine_pgids).since(s0)
        share = sched[SPEED_SIGNAL]
        cpu = {k: round(v - cpu0[k], 2) for k, v in _cpu_seconds(self.pgids).items()}
        live = summarize_records(records, policy=pol)
        print(f"{tag}: live {run_tps(live):.0f} tok/s; {live.summary['failed']} failed; load average {load0:.1f} -> "
              f"{os.getloadavg()[0]:.1f}; CPU seconds over {wall:.1f} s: {cpu}; run share {_fmt_shares(share)}",
              flush=True)
        return live, {"replay_wall_s": round(wall, 2), "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
                      "cpu_s": cpu, "run_share": share, "sched": sched}

    def simulate(self, pol: str, rep: int, lived: tuple[SimResult, dict[str, Any]],
                 before: tuple[LoadedFit, RequestPath], after: tuple[LoadedFit, RequestPath]) -> RealPoint:
        live, cond = lived
        profile, factor, pre, ct = bracketed(before[0], after[0], self.cal.profile)
        write_profile(profile, self.work / f"calibrated-under-load-{pol}-r{rep}.yaml")
        path = RequestPath(pre, (before[1].post + after[1].post) / 2)
        wl = with_turnaround(self.wl, path.turnaround, self.max_think_s)
        bracket = simulate_like(wl, profile, pol, self.engines, self.rate, self.seed, 1e9)
        cal_share = {k: (before[0].run_share[k] + after[0].run_share[k]) / 2 for k in cond["run_share"]}
        steal = measured_slowdowns(factor, cal_share, cond["run_share"])
        # engine i of the live cluster is the simulator's instance i (both in start order)
        sim = simulate_per_instance(wl, [slowed(self.cal.profile, steal[e.instance_id]) for e in self.running], pol,
                                    self.rate, self.seed, 1e9)
        cond = {**cond, "idle_path_pre_s": (before[1].pre + after[1].pre) / 2, "slowdown": factor,
                "slowdown_before_after": [round(before[0].slowdown, 3), round(after[0].slowdown, 3)],
                "tput_calibration": [run_tps(before[0].live), run_tps(after[0].live)],
                "run_share_calibration": cal_share, "slowdown_steal": steal,
                "sched_calibration": [before[0].sched, after[0].sched]}
        return RealPoint(pol, rep, live, sim, path, ct, cond, bracket)


def _fmt_shares(share: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in share.items())


def table(rows: list[dict[str, Any]]) -> str:
    """Live against simulated (each engine at its measured speed); "bracketed": every engine at the
    calibrations' mean speed (the earlier model); "sim const": a constant request path (no contention)."""
    head = ["policy", "tok/s live", "sim", "bracketed", "TTFT p50 live", "sim", "bracketed", "sim const",
            "local hit live", "sim", "bracketed", "sticky live", "sim"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        name = r["policy"] + (f" #{r['repeat']}" if "repeat" in r else "")
        lines.append(f"| {name} | {r['tput_live']:.0f} | {r['tput_sim']:.0f} | {r['tput_sim_bracketed']:.0f} | "
                     f"{r['ttft_p50_live']:.3f} | {r['ttft_p50_sim']:.3f} | {r['ttft_p50_sim_bracketed']:.3f} | "
                     f"{r['ttft_p50_sim_const']:.3f} | {r['hit_live']:.3f} | {r['hit_sim']:.3f} | "
                     f"{r['hit_sim_bracketed']:.3f} | {r['sticky_live']:.3f} | {r['sticky_sim']:.3f} |")
    return "\n".join(lines) + "\n"


def conditions_table(rows: list[dict[str, Any]]) -> str:
    """What each replay ran under: the fitted engine slowdown and request path (calibration replay), the
    idle path, the machine's load, who used the CPU."""
    names = sorted({k for r in rows for k in r["cpu_s"]})
    head = ["policy", "cal tok/s before, after", "slowdown before, after: used", "path pre (ms)", "base", "per in flight", "idle", "post (ms)",
            "load avg 1m (start, end)", "replay wall (s)", *(f"CPU s {n}" for n in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        la = r["load_avg_1m"]
        ba, tc = r["slowdown_before_after"], r["tput_calibration"]
        lines.append(f"| {r['policy']} #{r['repeat']} | {tc[0]:.0f}, {tc[1]:.0f} | {ba[0]:.2f}, {ba[1]:.2f}: "
                     f"{r['slowdown']:.2f} | "
                     f"{r['path_pre_s'] * 1e3:.1f} | {r['path_base_s'] * 1e3:.1f} | "
                     f"{r['path_per_inflight_s'] * 1e3:.1f} | {r['idle_path_pre_s'] * 1e3:.1f} | "
                     f"{r['path_post_s'] * 1e3:.1f} | {la[0]:.1f}, {la[1]:.1f} | {r['replay_wall_s']:.1f} | "
                     + " | ".join(f"{r['cpu_s'].get(n, 0.0):.2f}" for n in names) + " |")
    return "\n".join(lines) + "\n"
