"""Live, side by side: our router and the routers users run today, in front of the same mock cluster.

    python bench/live_peers.py            # 8 instances, both workloads, every configuration tuned, runs side by side
    python bench/live_peers.py --quick    # 4 instances, Trace-1, 2 loads around the knee, 8 configurations
    python bench/live_peers.py --quick --workloads weka   # the same routers on the WEKA sessions (~45 min)
    python bench/live_peers.py --quick --tuned-only   # the peers' tuning sweep at the quick settings
    python bench/live_peers.py --ci       # 8 instances, Trace-1 only, 2 loads, short (the CI test)
    python bench/live_peers.py --quick --parallel 4   # any mode, K runs at once (each its own cluster)

Router configurations: ours through our controller + gateway (``smetric``, ``smetric_ect``,
``load_balance``), vLLM's router ``vllm-router`` 0.1.17 (``kv_aware`` fed by the engines' KV events,
``sticky_least_loaded``, ``cache_aware``, ``power_of_two``, ``round_robin``) and SGLang's
``sglang-router`` 0.3.2 (``cache_aware``, ``power_of_two``). Each run starts a fresh mock cluster
(``smetric mock-engine``: the simulator's engine model in real time, one global KV tier shared by
the instances, LMCache's retrieve path at its default cost), the router in front of it, and replays
the workload with ``smetric replay``'s runner (every turn resends the session's context as token
ids to ``/v1/completions``). The workloads: the Trace-1 preset and the real WEKA Claude Code
sessions (``$SMETRIC_SHARED/traces``), their contexts scaled down so a 2-core machine can drive them.

Per run: TPS within SLO, TTFT p50/p99, where prompt tokens came from (the engines' own counters:
GPU prefix cache, global tier, computed), load imbalance (max / mean prompt tokens per instance),
the router's CPU seconds per 1,000 requests (``/proc`` of its processes) and what the router itself
says it did (its Prometheus counters), so no configuration can silently fall back to round robin.
Added latency: the same small request to instant engines (``--speed 1000``), straight to an engine,
through the router and straight again, back to back; the router's share is the percentiles of the
per-triple differences (through minus straight), reported with the probe's own noise (the two
straight requests' difference) and the machine's steal share and run queue over the same seconds.

Ends with ONE JSON line: ``{"instances", "workloads", "ours_best", "best_peer",
"ours_vs_best_peer_tps_slo", "smetric_vs_best_peer_tps_slo", "router_cpu_ms_per_1k",
"router_added_latency_p99_ms", "router_added_latency_p50_ms", "latency_probe_noise_p99_ms", "peers_tuned"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from smetric_lmc.lab.mock_engine.cli import MockInstance
from smetric_lmc.lab.mock_engine.stack import start_mock_engines
from smetric_lmc.lab.mock_engine.tokenizer_dir import write_tokenizer_dir
from smetric_lmc.lab.replay.prompts import TokenSpace
from smetric_lmc.lab.replay.runner import ReplayConfig, replay
from smetric_lmc.lab.replay.summary import summarize_records
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.workload.model import Workload
from smetric_lmc.lab.workload.presets import preset_workload
from smetric_lmc.workers import launch, up

OURS = ("smetric", "smetric_ect", "load_balance")
VLLM = ("kv_aware", "sticky_least_loaded", "cache_aware", "power_of_two", "round_robin")
SGLANG = ("cache_aware", "power_of_two")


@dataclass(frozen=True)
class RouterConf:
    family: str  # ours | vllm | sglang
    policy: str
    params: tuple[tuple[str, str], ...] = ()  # extra CLI flags (peers) or policy overrides (ours)
    tuned: bool = False
    # the headers that carry each session's key to this router (None: its family's, SESSION_HEADERS)
    session_headers: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        base = f"{self.family}:{self.policy}"
        extra = [f"{k.lstrip('-')}={v}" for k, v in self.params]
        if self.session_headers is not None:
            extra.append(f"session-header={'+'.join(self.session_headers) or 'none'}")
        return base + ("[" + ",".join(extra) + "]" if extra else "")

    @property
    def headers(self) -> tuple[str, ...]:
        return SESSION_HEADERS[self.family] if self.session_headers is None else self.session_headers


def default_confs() -> list[RouterConf]:
    # ours:smetric[process=one]: the gateway runs the controller in its own process (--with-controller)
    return ([RouterConf("ours", p) for p in OURS] + [RouterConf("ours", "smetric", (("process", "one"),))]
            + [RouterConf("vllm", p) for p in VLLM] + [RouterConf("sglang", p) for p in SGLANG])


def tuning_confs() -> list[RouterConf]:
    """The small sweep of each tunable peer's documented knobs (never ours: our policies run with
    their defaults)."""
    out: list[RouterConf] = []
    for fam in ("vllm", "sglang"):
        for thr, bal in (("0.1", "4"), ("0.6", "16")):
            out.append(RouterConf(fam, "cache_aware", (("--cache-threshold", thr),
                                                      ("--balance-abs-threshold", bal)), True))
    out.append(RouterConf("vllm", "kv_aware", (("--kv-penalty-external", "0.9"),), True))
    out.append(RouterConf("vllm", "kv_aware", (("--kv-aware-session-affinity-ttl-secs", "60"),), True))
    return out


@dataclass
class Mode:
    instances: int
    workloads: tuple[str, ...]
    loads: tuple[float, ...]  # root sessions per second
    sessions: int  # root sessions replayed per run
    context_scale: float
    tune: bool
    latency_requests: int  # 0: no added-latency phase
    fresh_per_load: bool = True  # False (CI): one cluster + router per configuration, loads in a row
    weka_sessions: int = 4  # WEKA sessions run ~60 turns each (Trace-1's ~6): fewer roots
    # WEKA's offered load: its sessions start over this window (sessions per run = load x window),
    # its loads (root sessions/s), prompts scaled by weka_context_scale (its contexts average ~123 k
    # tokens, Trace-1's ~42 k: the same scale would leave most WEKA prompts past --max-model-len) and
    # answers capped at weka_max_output tokens (a session's ~60 turns run one after the other: the
    # cap keeps one run at tens of seconds instead of minutes). None: the Trace-1 settings.
    weka_loads: tuple[float, ...] | None = None
    weka_window_s: float | None = None
    weka_context_scale: float | None = None
    weka_max_output: int | None = None
    max_output: int | None = None  # cap on every answer (None: the scaled recorded length)
    speed: float = 0.25  # the mock engines' speed against the profile (lower: the knee at a lower load)
    time_scale: float = 0.05  # think times and arrival gaps scaled by this
    max_think_s: float = 60.0  # recorded think times clipped here (before time_scale)
    routers: tuple[str, ...] | None = None  # the router configurations run (None: all)
    latency_routers: tuple[str, ...] = ()  # more configurations, for the added-latency phase only
    # Sessions per run grow with the load (rate x this window, at least ``sessions``): with a fixed
    # count every load above count/session-length offers the same work, and no sweep passes the knee.
    arrival_window_s: float | None = None
    # The Trace-1 preset is drawn once, sized for this load (None: the top load), so that every load
    # replays sessions of the same draw; quick keeps 18, its former top load, to keep its earlier draw.
    pool_rate: float | None = None
    # Runs of one workload at once, each on its own mock cluster and router (1: one after the
    # other). A WEKA run waits on its longest session's ~60 turns one after the other and keeps the
    # machine mostly idle (~17% of one core at 8 instances), so several fit side by side; every row
    # carries the engines' late-step share, which says whether the machine still kept their pace.
    parallel: int = 1
    weka_parallel: int | None = None

    def sessions_at(self, rate: float, workload: str = "trace1") -> int:
        if workload == "weka":
            if self.weka_window_s is None:
                return self.weka_sessions
            return max(self.weka_sessions, round(rate * self.weka_window_s))
        if self.arrival_window_s is None:
            return self.sessions
        return max(self.sessions, round(rate * self.arrival_window_s))

    def loads_of(self, workload: str) -> tuple[float, ...]:
        return self.weka_loads if workload == "weka" and self.weka_loads else self.loads

    def context_scale_of(self, workload: str) -> float:
        return self.weka_context_scale if workload == "weka" and self.weka_context_scale else self.context_scale

    def max_output_of(self, workload: str) -> int | None:
        return self.weka_max_output if workload == "weka" and self.weka_max_output else self.max_output

    def parallel_of(self, workload: str) -> int:
        return self.weka_parallel if workload == "weka" and self.weka_parallel else self.parallel


# --quick: 4 instances, engines at 0.18x the profile (slower and decode alone breaks the 30 ms TPOT
# SLO), sessions per run = load x 2.5 s, think times short and clipped so that a run lasts 15-30 s,
# 2 loads: 6 and 12 sessions/s, where every configuration peaked in the 4-load runs of 2026-12-06
# (2 / 6 / 12 / 18 sessions/s, docs/peers.md: no configuration's best was at 2, where all serve the
# same ~5k tok/s, or at 18, where all have collapsed, and those two points took 60% of the run's
# time). Trace-1 only (WEKA's ~60-turn sessions make each WEKA run minutes long: --workloads weka
# runs them) and the two load-only peer policies with a twin in the set (vLLM's round_robin,
# SGLang's power_of_two) left to the full mode and CI: all to fit 8 minutes on a shared 2-core machine.
QUICK_ROUTERS = ("ours:smetric", "ours:smetric_ect", "ours:load_balance", "vllm:kv_aware", "vllm:sticky_least_loaded",
                 "vllm:cache_aware", "vllm:power_of_two", "sglang:cache_aware")
MODES = {
    # full: the quick calibration on 8 instances, at the loads where every configuration peaked in the
    # 8-instance runs of 2026-12-07 (Trace-1: 9 to 24 sessions/s; WEKA: 6 and 10), every configuration
    # tuned. A run keeps the machine 4-9% busy (it waits on the modelled engines' time), so runs go
    # side by side: 6 Trace-1 runs, 8 WEKA runs at once (each its own cluster and router; every row
    # says how late the engines' steps ended and how busy the machine was). The Trace-1 draw is the
    # one the earlier 16-instance calibration sized (pool_rate 48), so its sessions are those runs'.
    # --instances 16 runs it at twice the size (its knees not calibrated: pass --loads / --weka-loads).
    "full": Mode(8, ("trace1", "weka"), (9.0, 12.0, 16.0, 24.0), 8, 0.05, True, 1000, fresh_per_load=False,
                 speed=0.18, time_scale=0.02, max_think_s=15.0, arrival_window_s=2.5, pool_rate=48.0,
                 weka_loads=(6.0, 10.0), weka_window_s=4.0, weka_context_scale=0.03,
                 parallel=6, weka_parallel=8),
    "quick": Mode(4, ("trace1",), (6.0, 12.0), 4, 0.05, False, 200, fresh_per_load=False,
                  weka_sessions=2, speed=0.18, time_scale=0.02, max_think_s=15.0, routers=QUICK_ROUTERS,
                  latency_routers=("ours:smetric[process=one]",), arrival_window_s=2.5,
                  weka_loads=(2.0, 4.0, 8.0), weka_window_s=4.0, weka_context_scale=0.03, pool_rate=18.0),
    "ci": Mode(8, ("trace1",), (0.5, 2.0), 2, 0.03, False, 0, fresh_per_load=False, parallel=2),
}

# The mock engines: the simulator's default profile, KV capacity cut so prefixes get evicted at
# these scaled-down contexts (routing matters only when caches fill), a global tier shared by the
# instances, engines 4x slower than the profile so the knee falls at a rate two cores can offer.
# Topic "": vLLM's default, and the only topic vllm-router's static --kv-event-source subscribes to
# (it drops every frame whose topic is not exactly its own, so with the mock's own default "kv" its
# kv_aware index stayed empty and it never credited a cached prefix).
EVENT_ARGS = ("--topic", "")
# The header each family reads a session's key from by default: vllm-router's session key for its
# sticky policies and kv_aware's session affinity (it also reads session-id, x-claude-code-session-id,
# x-user-id and the body's session_params.session_id / user); SGLang's router's routing key (in 0.3.2
# its manual policy's input: cache_aware placed the same with or without it, docs/peers.md); ours (our
# gateway takes the turn from X-SMetric-Turn as well).
SESSION_HEADERS = {"ours": ("X-SMetric-Session",), "vllm": ("x-session-id",), "sglang": ("X-SMG-Routing-Key",)}
GATEWAY_TOKENIZE = "local"  # our gateway's tokenizer: "local" (--tokenizer) or "engine" (/tokenize); --gateway-tokenize
# the TPOT SLO the replay's summary judges by; the engines count against the same one
SLO_TPOT_S = load_sim_config(None).slo.tpot_s
MOCK_ARGS = ("--num-gpu-blocks", "192", "--max-model-len", "6144", "--global-gib", "4",
             "--tpot-slo-ms", str(1e3 * SLO_TPOT_S), *EVENT_ARGS)
# What our controller knows of the global tier: "redis" (the default since 2026-12-07): each cluster
# gets its own redis-server, the mock names its tier's chunks there as LMCache's redis connector does
# and our controller follows them (global_store kind redis), as it follows a real LMCache + Redis;
# "none" (the runs before): the tier is invisible to it. The peers model no global tier either way.
GLOBAL_VIEW = "redis"


# ---- processes ---------------------------------------------------------------------------------
def _cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds of ``pids`` and their children that were waited for."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in f[11:15]) / tick  # utime stime cutime cstime
    return total


def _cpu_ticks() -> tuple[float, float]:
    """The machine's (steal, total) CPU ticks so far (``/proc/stat``)."""
    steal, total, _ = _cpu_ticks3()
    return steal, total


def _cpu_ticks3() -> tuple[float, float, float]:
    """The machine's (steal, total, idle + iowait) CPU ticks so far (``/proc/stat``)."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return float(f[7]), sum(float(x) for x in f), float(f[3]) + float(f[4])


class Router:
    """One router configuration running in front of ``infos``; ``url`` takes OpenAI requests."""

    def __init__(self, conf: RouterConf, infos: list[MockInstance], workdir: Path,
                 store_url: str | None = None) -> None:
        self.conf = conf
        self.infos = infos
        self.workdir = workdir
        self.store_url = store_url  # the Redis that names the cluster's global tier (ours reads it)
        self.groups: list[launch.ProcessGroup] = []
        self.url = ""
        self.metrics_url = ""
        self.argv: list[str] = []

    def start(self) -> None:
        if self.conf.family == "ours":
            self._start_ours()
        else:
            self._start_peer()

    def _start_ours(self) -> None:
        route_port, metrics_port, port = launch.free_ports(3)
        overrides = dict(self.conf.params)
        one_process = overrides.pop("process", "two") == "one"  # the gateway embeds the controller
        cfg = up.controller_config(self.infos, route_url=f"tcp://127.0.0.1:{route_port}",  # type: ignore[arg-type]
                                   metrics_port=metrics_port, policy=self.conf.policy,
                                   policy_overrides=overrides or None, metrics_poll_s=1.0)
        for inst in cfg["instances"]:
            inst["kv_events_topic"] = EVENT_ARGS[1]  # the engines' topic (see EVENT_ARGS)
        if self.store_url:
            cfg["global_store"] = {"kind": "redis", "url": self.store_url}
        path = up.write_config(cfg, self.workdir / "smetric.yaml")
        if not one_process:
            self.groups.append(up.start_controller(path, metrics_port, self.workdir))
        # The mock's tokenizer as a directory: the gateway tokenizes locally, as it does in front of
        # vLLM with --tokenizer; GATEWAY_TOKENIZE = "engine" measures the /tokenize round trip instead.
        tok = write_tokenizer_dir(self.workdir / "tokenizer") if GATEWAY_TOKENIZE == "local" else None
        self.groups.append(up.start_gateway(path, port, self.workdir, tokenizer=tok,
                                            extra_args=["--with-controller"] if one_process else ()))
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.argv = ([] if one_process else [f"smetric controller --config smetric.yaml  (policy: {self.conf.policy})"]) + [
            f"smetric gateway --config smetric.yaml --port {port}" + (" --with-controller" if one_process else "")
            + (" --tokenizer tokenizer/  (the mock's byte tokenizer, written as a tokenizer dir)" if tok else "")]

    def _start_peer(self) -> None:
        port, prom = launch.free_ports(2)
        urls = [i.http_url for i in self.infos]
        exe = shutil.which(f"{self.conf.family}-router", path=str(Path(sys.executable).parent)) \
            or shutil.which(f"{self.conf.family}-router")
        if exe is None:
            raise RuntimeError(f"{self.conf.family}-router is not installed (pip install -e '.[live-peers]')")
        argv = [exe] + (["launch"] if self.conf.family == "sglang" else [])
        argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", self.conf.policy,
                 "--worker-urls", *urls, "--prometheus-port", str(prom), "--prometheus-host", "127.0.0.1",
                 "--worker-startup-check-interval", "1", "--log-level", "info"]
        if self.conf.family == "vllm" and self.conf.policy == "kv_aware":
            argv += ["--kv-event-model", self.infos[0].model,
                     "--kv-event-block-size", str(self.infos[0].block_size)]
            for i in self.infos:
                argv += ["--kv-event-source", f"{i.http_url}={i.kv_events_endpoint}"]
                if i.replay_endpoint:
                    argv += ["--kv-event-replay-source", f"{i.http_url}={i.replay_endpoint}"]
        for k, v in self.conf.params:
            argv += [k, v]
        g = launch.ProcessGroup(argv, dict(os.environ), self.workdir / "router.log", self.conf.name)
        g.start()
        self.groups.append(g)
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{prom}/metrics"
        self.argv = [" ".join([Path(argv[0]).name, *argv[1:]])]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if g.poll() is not None:
                raise RuntimeError(f"{self.conf.name} exited; log tail:\n{launch.tail_file(g.log_path)}")
            try:
                import urllib.request

                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.conf.name} not up after 60 s")

    def policy_log(self) -> list[str]:
        """The router's own log lines naming the policy it runs (peers only)."""
        import re

        path = self.workdir / "router.log"
        if self.conf.family == "ours" or not path.exists():
            return []
        text = re.sub(r"\x1b\[[0-9;]*m", "", path.read_text(errors="replace"))
        return [ln[-220:] for ln in text.splitlines() if "Assigning policy" in ln or "policy: " in ln][:2]

    def cpu_s(self) -> float:
        return _cpu_s([p for p in (g.pid for g in self.groups) if p])

    def stop(self) -> None:
        for g in reversed(self.groups):
            g.stop()


# ---- measuring ---------------------------------------------------------------------------------
async def _get_json(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
        return await r.json()


async def _get_text(s: aiohttp.ClientSession, url: str) -> str:
    try:
        async with s.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
            return await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return f"# unreachable: {exc}"


def engine_stats(infos: list[MockInstance]) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            return list(await asyncio.gather(*(_get_json(s, f"{i.http_url}/mock/stats") for i in infos)))

    return asyncio.run(main())


def store_key_events(url: str | None) -> int:
    """Keyspace notifications the cluster's Redis has sent so far: one per key SET, two per chunk DEL
    (the mock deletes a chunk's two keys with one DEL); 0 without a store."""
    if not url:
        return 0
    import redis

    stats = redis.Redis.from_url(url).info("commandstats")
    return int(stats.get("cmdstat_set", {}).get("calls", 0)) + 2 * int(stats.get("cmdstat_del", {}).get("calls", 0))


def router_counters(url: str, family: str) -> dict[str, float]:
    """The router's own account of its decisions, from its Prometheus text."""
    async def main() -> str:
        async with aiohttp.ClientSession() as s:
            return await _get_text(s, url)

    text = asyncio.run(main())
    # ours: also the learned TTFT fit's noise (smetric_ect's move margin scales with it)
    keep = {"ours": ("smetric_route_decisions_total", "smetric_routed_total", "smetric_decisions_total",
                     'smetric_price_ttft_noise{backend="cluster"}', "smetric_route_hit_tokens_total"),
            "vllm": ("vllm_router_prefix_routing_decisions_total", "vllm_router_kv_placement_lookups_total",
                     "vllm_router_policy_decisions_total", "vllm_router_processed_requests_total"),
            "sglang": ("smg_router_", "smg_worker_requests", "policy_decisions", "cache_hits", "cache_misses",
                       "processed_requests", "smg_worker_selected", "smg_routing")}[family]
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not any(k in line for k in keep) or "_bucket" in line or "duration" in line:
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def summarize_counters(c: dict[str, float]) -> dict[str, float]:
    """Collapse per-worker series into per-outcome totals so a row stays readable."""
    agg: dict[str, float] = {}
    for name, v in c.items():
        base = name.split("{", 1)[0]
        labels = name.split("{", 1)[1].rstrip("}") if "{" in name else ""
        keep = [x for x in labels.split(",") if x and not x.startswith(("worker=", "url="))]
        key = base + ("{" + ",".join(keep) + "}" if keep else "")
        agg[key] = agg.get(key, 0.0) + v
    return agg


_START_LOCK = threading.Lock()
_LIVE: set[Any] = set()  # the routers and mock processes of the runs going on (each has stop())
_STOPPED = threading.Event()  # set by stop_live: no run starts, and one starting stops itself


class SweepStopped(RuntimeError):
    pass


def stop_live() -> None:
    """Stop every run's router and mock cluster still up (a parallel sweep stopped early), and every
    run still starting: it finds the flag set once it has registered what it started."""
    _STOPPED.set()
    for part in list(_LIVE):
        part.stop()


def _register(*parts: Any) -> None:
    """Count ``parts`` among the live ones; if the sweep was stopped meanwhile, stop them now (the flag
    is set before stop_live looks at _LIVE, so a part registered after that look sees it)."""
    _LIVE.update(parts)
    if _STOPPED.is_set():
        for part in parts:
            part.stop()
        raise SweepStopped("the sweep was stopped")


def run_group(conf: RouterConf, wl_name: str, wl: Workload, rates: Sequence[float], mode: Mode,
              root: Path) -> list[dict[str, Any]]:
    """A fresh mock cluster and ``conf`` in front of it; the workload replayed at each of ``rates`` in
    turn (one rate per cluster unless the mode says otherwise)."""
    if _STOPPED.is_set():
        raise SweepStopped("the sweep was stopped")
    work = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    groups: list[Any] = []
    router: Router | None = None
    rows: list[dict[str, Any]] = []
    try:
        with _START_LOCK:  # one cluster starting at a time: a port picked free stays free until bound
            store_url, extra = None, []
            if GLOBAL_VIEW == "redis":
                store = launch.start_global_store("redis", log_dir=work)
                groups.append(store.process)
                _register(store.process)
                store_url = f"redis://{store.address}/0"
                extra = ["--global-store-keys", store_url]
            started = start_mock_engines(mode.instances, work, processes=1,
                                         extra_args=[*MOCK_ARGS, *extra, "--speed", str(mode.speed)])
            mocks = list({id(g): g for _, g in started}.values())
            groups = mocks + groups  # the mocks stop before their store
            _register(*mocks)
            infos = [i for i, _ in started]
            router = Router(conf, infos, work, store_url)
            _register(router)  # before it starts: a stop meanwhile stops what it has started so far
            router.start()
            _register(router)  # and a stop during its start stops the rest
        for rate in rates:
            if _STOPPED.is_set():
                raise SweepStopped("the sweep was stopped")
            rows.append(_measure(router, infos, conf, wl_name, wl, rate, mode))
    finally:
        if router is not None:
            router.stop()
        for g in groups:
            g.stop()
        _LIVE.difference_update((router, *groups))
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _measure(router: Router, infos: list[MockInstance], conf: RouterConf, wl_name: str, wl: Workload,
             rate: float, mode: Mode) -> dict[str, Any]:
    before = engine_stats(infos)
    events0 = store_key_events(router.store_url)
    cpu0, ticks0, t0, start_epoch = router.cpu_s(), _cpu_ticks3(), time.monotonic(), time.time()
    sessions = mode.sessions_at(rate, wl_name)
    scale = mode.context_scale_of(wl_name)
    cfg = ReplayConfig(url=router.url, rate=rate, sessions=sessions, context_scale=scale,
                       output_scale=scale, max_output=mode.max_output_of(wl_name), time_scale=mode.time_scale,
                       max_think_s=mode.max_think_s,
                       max_model_len=6144, timeout_s=120.0, seed=1,
                       # text prompts (ASCII ids) for every router: SGLang's takes text only
                       tokens=TokenSpace(128, 16), text_prompts=True,
                       # each request with its session's key in the header the router reads it from
                       session_headers=conf.headers)
    records = replay(wl, cfg)
    wall = time.monotonic() - t0
    cpu = router.cpu_s() - cpu0
    ticks = _cpu_ticks3()
    steal = (ticks[0] - ticks0[0]) / max(1.0, ticks[1] - ticks0[1])  # the machine's steal share in the run
    # the share of the machine's CPUs busy over the run (every process, the runs beside it included)
    busy = 1.0 - (ticks[2] - ticks0[2] + ticks[0] - ticks0[0]) / max(1.0, ticks[1] - ticks0[1])
    res = summarize_records(records, load_sim_config(None), conf.name).summary
    after = engine_stats(infos)
    events = store_key_events(router.store_url) - events0
    counters = summarize_counters(router_counters(router.metrics_url, conf.family))

    def delta(key: str) -> list[float]:
        return [a["counters"][key] - b["counters"][key] for a, b in zip(after, before)]

    prompt = delta("prompt_tokens")
    gpu = sum(delta("gpu_hit_tokens"))
    glob = sum(delta("global_hit_tokens")) + sum(delta("cpu_hit_tokens"))
    total = max(1, sum(prompt))
    n_ok = max(1, res["requests"] - res["failed"])
    steps = max(1, sum(delta("steps")))
    return {"router": conf.name, "family": conf.family, "policy": conf.policy, "tuned": conf.tuned,
            "workload": wl_name, "rate": rate, "instances": mode.instances, "requests": res["requests"],
            "failed": res["failed"], "global_view": GLOBAL_VIEW,
            # keyspace notifications the store sent a follower per routed request (0: no store)
            "store_key_events_per_request": round(events / max(1, res["requests"]), 2),
            "tps_slo": res["tps_slo"], "ttft_p50": res.get("ttft_p50"), "ttft_p99": res.get("ttft_p99"),
            "tpot_p50": res.get("tpot_p50"), "tpot_p99": res.get("tpot_p99"),
            "lost_ttft": res.get("tokens_lost_ttft"), "lost_tpot": res.get("tokens_lost_tpot"),
            "local_share": gpu / total, "global_share": glob / total, "miss_share": 1 - (gpu + glob) / total,
            "imbalance": max(prompt) / max(1e-9, statistics.mean(prompt)) if prompt else 0.0,
            "per_instance_requests": delta("requests_ok"),
            # per instance: GPU busy share over the run, and the share of its finished tokens whose
            # requests passed the TPOT SLO there (do the losses sit on the busiest instances?)
            "per_instance_gpu_busy": [round(b / max(1e-9, wall), 4) for b in delta("busy_s")],
            "per_instance_mixed_share": [round(m / max(1e-9, b), 4) for m, b in zip(delta("mixed_s"), delta("busy_s"))],
            "per_instance_slow_tpot": [round(sl / max(1, f), 4)
                                       for sl, f in zip(delta("slow_tpot_tokens"), delta("finished_tokens"))],
            # the mock engines' own timekeeping: how late their steps ended, in wall time (a share of
            # late steps near 0 says the machine kept the modelled cluster's pace)
            "step_lag_ms": 1e3 * sum(delta("step_lag_sum_s")) / steps, "late_steps": sum(delta("steps_late")) / steps,
            # the engines' own mean time per output token (vLLM's inter-token latency), beside the
            # client's TPOT: a gap between them is time the tokens spent between engine and client
            "engine_itl_ms": 1e3 * sum(delta("itl_sum_s")) / max(1, sum(delta("itl_count"))),
            # what that time per token is made of, from the engines' model: the mean iteration, the
            # share of the GPUs' busy time in steps that carried prompt chunks, and the share spent
            # waiting on loads and stores (a sync fetch holds the whole batch); GPU busy per instance
            **_engine_time(delta("busy_s"), delta("mixed_s"), delta("stall_s"), delta("iterations"), wall),
            # the tokens of requests past the TPOT SLO (whatever their TTFT), as the client timed them
            # and as the engines did: a gap is time spent between engine and client, not in the engines
            "slow_tpot_share": _slow_tpot_share(records, SLO_TPOT_S),
            "engine_slow_tpot_share": sum(delta("slow_tpot_tokens")) / max(1, sum(delta("finished_tokens"))),
            # of those tokens, the share whose requests would have met the SLO had their decodes not
            # sat through other requests' loads and stores (the fetches' part of the TPOT losses)
            "slow_tpot_by_waits": sum(delta("slow_tpot_tokens_by_waits")) / max(1, sum(delta("slow_tpot_tokens"))),
            "router_cpu_ms_per_1k": cpu * 1e3 / n_ok * 1000, "wall_s": wall, "steal": steal,
            "started": start_epoch, "machine_busy": busy,
            "counters": counters, "policy_log": router.policy_log(), "argv": router.argv,
            "session_headers": list(conf.headers)}


def _slow_tpot_share(records: list[Any], slo_s: float) -> float:
    """Prompt + output tokens of the served requests whose time per output token passed ``slo_s``,
    over those of all served requests."""
    total = slow = 0
    for r in records:
        if not r.ok:
            continue
        n = r.input + r.output
        total += n
        if r.output > 1 and (r.finish - r.first_token) / (r.output - 1) > slo_s:
            slow += n
    return slow / max(1, total)


def _engine_time(busy: list[float], mixed: list[float], stall: list[float], iterations: list[float],
                 wall: float) -> dict[str, float]:
    b = max(1e-9, sum(busy))
    return {"iteration_ms": 1e3 * sum(busy) / max(1.0, sum(iterations)), "mixed_share": sum(mixed) / b,
            "stall_share": sum(stall) / b, "gpu_busy": sum(busy) / max(1e-9, wall * max(1, len(busy)))}


async def _latency(direct: str, via: str, n: int, rate: float) -> list[tuple[float, float, float]]:
    """``n`` triples of the same small completion at ``rate`` triples per second: one straight to an
    engine, one through the router and one straight again, back to back (the order rotates, so no leg
    gets the others' warm caches for free); each triple's three latencies in ms. The second straight
    request measures the probe's own noise: the spread of two identical requests a moment apart."""
    out: list[tuple[float, float, float]] = []
    body = {"model": "tiny", "prompt": "".join(map(chr, range(32, 96))), "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        async def one(url: str) -> float | None:
            t = time.perf_counter()
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.read()
                return (time.perf_counter() - t) * 1e3 if r.status == 200 else None

        for k in range(n):
            t = time.perf_counter()
            if k % 3 == 0:
                d, v, d2 = await one(direct), await one(via), await one(direct)
            elif k % 3 == 1:
                v, d2, d = await one(via), await one(direct), await one(direct)
            else:
                d2, d, v = await one(direct), await one(direct), await one(via)
            if d is not None and v is not None and d2 is not None:
                out.append((d, v, d2))
            await asyncio.sleep(max(0.0, 1 / rate - (time.perf_counter() - t)))
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def _contention() -> tuple[float, float, float]:
    """(steal ticks, all ticks, runnable tasks now) from ``/proc/stat``."""
    steal, total = _cpu_ticks()
    running = next((float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                    if ln.startswith("procs_running")), float("nan"))
    return steal, total, running


def _routing_note(a: dict[str, float]) -> str:
    if "gateway_routing_mean_ms" not in a:
        return ""
    rtt = a.get("gateway_route_rtt_mean_ms")
    return (f"; the gateway's own routing before the engine saw a request: mean {a['gateway_routing_mean_ms']:.2f} ms"
            + (f" (the controller's round trip {rtt:.2f})" if rtt is not None else ""))


def latency_summary(triples: Sequence[tuple[float, float, float]]) -> dict[str, float]:
    """Percentiles of the per-triple differences (through the router minus straight): the router's
    own time, with the machine's noise common to the requests of a triple cancelled. ``noise_*``: the
    same percentiles of the two straight requests' difference, the probe's floor (what the machine
    adds to a difference when the router adds nothing)."""
    diffs = [v - d for d, v, _ in triples]
    floor = [d2 - d for d, _, d2 in triples]
    return {"pairs": len(triples), "p50_ms": _pct(diffs, 50), "p90_ms": _pct(diffs, 90), "p99_ms": _pct(diffs, 99),
            "noise_p50_ms": _pct(floor, 50), "noise_p99_ms": _pct(floor, 99),
            "direct_p50_ms": _pct([d for d, _, _ in triples], 50), "via_p50_ms": _pct([v for _, v, _ in triples], 50)}


def added_latency(conf: RouterConf, mode: Mode, root: Path) -> dict[str, float]:
    """The router's added time over instant engines: per-pair differences, through it minus
    straight to an engine, with the machine's steal share and run queue over the same seconds."""
    work = Path(tempfile.mkdtemp(prefix="lat-", dir=root))
    started = start_mock_engines(mode.instances, work, processes=1, extra_args=["--speed", "1000", *EVENT_ARGS])
    infos = [i for i, _ in started]
    groups = list({id(g): g for _, g in started}.values())
    router = Router(conf, infos, work)
    try:
        router.start()
        asyncio.run(_latency(infos[0].http_url, router.url, 30, 100))  # warm-up (connections, caches)
        own = conf.family == "ours"
        g0 = gateway_routing(router.url) if own else {}
        c0, cpu0 = _contention(), router.cpu_s()
        triples = asyncio.run(_latency(infos[0].http_url, router.url, mode.latency_requests, 100))
        c1, cpu1 = _contention(), router.cpu_s()
        g1 = gateway_routing(router.url) if own else {}
    finally:
        router.stop()
        for g in groups:
            g.stop()
        shutil.rmtree(work, ignore_errors=True)
    out = latency_summary(triples)
    out["steal"] = (c1[0] - c0[0]) / max(1.0, c1[1] - c0[1])
    out["runnable"] = (c0[2] + c1[2]) / 2  # tasks wanting a CPU, at the start and end of the phase
    out["loadavg1"] = os.getloadavg()[0]
    # the router's CPU per request it proxied (its processes, all threads; background work included)
    out["router_cpu_ms_per_req"] = (cpu1 - cpu0) * 1e3 / max(1, len(triples))
    out.update(routing_means(g0, g1))
    return out


def routing_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Ours: what its gateway timed between two reads of its /metrics (``gateway_routing``), per
    request, before the engine saw it: reading and tokenizing the prompt and deciding
    (``gateway_routing_mean_ms``), the controller's round trip within that (``gateway_route_rtt_mean_ms``)."""
    out = {}
    for key in ("routing", "route_rtt"):
        n = after.get(f"{key}_count", 0.0) - before.get(f"{key}_count", 0.0)
        if n > 0:
            out[f"gateway_{key}_mean_ms"] = (after[f"{key}_sum"] - before[f"{key}_sum"]) * 1e3 / n
    return out


def gateway_routing(url: str) -> dict[str, float]:
    """Our gateway's routing and controller round-trip histograms (sums and counts) from its /metrics."""
    async def main() -> str:
        async with aiohttp.ClientSession() as s:
            return await _get_text(s, url + "/metrics")

    names = {"smetric_gateway_routing_seconds_sum": "routing_sum", "smetric_gateway_routing_seconds_count": "routing_count",
             'smetric_gateway_route_rtt_seconds_sum{outcome="ok"}': "route_rtt_sum",
             'smetric_gateway_route_rtt_seconds_count{outcome="ok"}': "route_rtt_count"}
    out: dict[str, float] = {}
    for line in asyncio.run(main()).splitlines():
        name, _, value = line.rpartition(" ")
        if name in names:
            out[names[name]] = float(value)
    return out


def load_workloads(names: Sequence[str], sessions: int) -> dict[str, Workload]:
    out: dict[str, Workload] = {}
    for name in names:
        if name == "trace1":
            out[name] = preset_workload("trace1", sessions * 4, seed=7)
        else:
            from smetric_lmc.lab.workload import load_any

            shared = Path(os.environ.get("SMETRIC_SHARED", "../shared"))
            path = shared / "traces" / "weka-claude-code.tar.xz"
            if not path.exists():
                raise SystemExit(f"live_peers: the WEKA trace is not at {path} (set SMETRIC_SHARED)")
            out[name] = load_any(path, progress=False)
    return out


# ---- report ------------------------------------------------------------------------------------
def best_per_router(rows: list[dict[str, Any]], wl: str) -> dict[str, float]:
    """Each configuration's best TPS within SLO over the load sweep (its knee); where a load was run
    more than once (--repeats, or several --from-rows files), the mean of its runs is that load's
    figure, so one lucky run does not make the peak."""
    runs: dict[tuple[str, float], list[float]] = {}
    for r in rows:
        if r["workload"] == wl:
            runs.setdefault((r["router"], r["rate"]), []).append(r["tps_slo"])
    best: dict[str, float] = {}
    for (router, _), tps in runs.items():
        best[router] = max(best.get(router, 0.0), statistics.mean(tps))
    return best


def load_means(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration, workload and load: the numeric fields averaged over its runs, with
    ``runs`` their count (the table of --repeats and of several --from-rows files)."""
    groups: dict[tuple[str, str, float, int], list[dict[str, Any]]] = {}
    for r in rows:  # rows of several cluster sizes (--from-rows) are never averaged together
        groups.setdefault((r["router"], r["workload"], r["rate"], r.get("instances", 0)), []).append(r)
    out = []
    for same in groups.values():
        m = dict(same[0], runs=len(same))
        for key, v in same[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and key != "rate":
                vals = [x.get(key) for x in same if isinstance(x.get(key), (int, float))]
                m[key] = type(v)(statistics.mean(vals)) if vals else v
        out.append(m)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'router':58s} {'wl':6s} {'rate':>5s} {'req':>5s} {'fail':>4s} {'TPS@SLO':>9s} {'TTFT50':>7s} "
            f"{'TTFT99':>7s} {'TPOT99':>7s} {'lostT':>6s} {'lostP':>6s} {'local':>6s} {'global':>6s} {'miss':>6s} "
            f"{'imbal':>6s} {'cpu/1k':>8s} {'late':>6s} {'itl':>5s} {'iter':>5s} {'stall':>6s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['router'][:58]:58s} {r['workload']:6s} {r['rate']:5.2f} {r['requests']:5d} {r['failed']:4d} "
                     f"{r['tps_slo']:9.0f} {r['ttft_p50'] or 0:7.2f} {r['ttft_p99'] or 0:7.2f} "
                     f"{1e3 * (r.get('tpot_p99') or 0):7.1f} {r.get('lost_ttft') or 0:6.1%} {r.get('lost_tpot') or 0:6.1%} "
                     f"{r['local_share']:6.1%} {r['global_share']:6.1%} {r['miss_share']:6.1%} "
                     f"{r['imbalance']:6.2f} {r['router_cpu_ms_per_1k']:8.0f} "
                     f"{'' if r.get('late_steps') is None else format(r['late_steps'], '.1%'):>6s} "
                     f"{_opt(r.get('engine_itl_ms'), '5.1f')} {_opt(r.get('iteration_ms'), '5.1f')} "
                     f"{_opt(r.get('stall_share'), '6.1%')}")
    return "\n".join(lines)


def decode_drivers(rows: list[dict[str, Any]]) -> str:
    """What the engines' time per output token moved with, over the runs: its correlation with the
    share of GPU time in steps that carried prompt chunks and with the share spent waiting on
    loads and stores, and that of the tokens lost to the TPOT SLO with the shares of prompt tokens
    computed (miss) and fetched (global). Empty with fewer than five runs that carry the fields."""
    keys = ("engine_itl_ms", "mixed_share", "stall_share", "lost_tpot", "miss_share", "global_share")
    have = [r for r in rows if all(isinstance(r.get(k), (int, float)) for k in keys)]
    if len(have) < 5:
        return ""

    def corr(a: str, b: str) -> str:
        try:
            return f"{statistics.correlation([r[a] for r in have], [r[b] for r in have]):+.2f}"
        except statistics.StatisticsError:  # a constant column
            return "n/a"

    return (f"what slows the decodes, over {len(have)} runs (Pearson r): engine time per token with the GPU "
            f"time in steps carrying prompt chunks {corr('engine_itl_ms', 'mixed_share')}, with the time "
            f"waiting on loads and stores {corr('engine_itl_ms', 'stall_share')}; tokens lost to the TPOT SLO "
            f"with the prompt share computed {corr('lost_tpot', 'miss_share')}, with the share fetched "
            f"from the global tier {corr('lost_tpot', 'global_share')}" + _slow_tpot_line(have)
            + _per_instance_line(have))


def _per_instance_line(rows: list[dict[str, Any]]) -> str:
    """Whether the requests past the TPOT SLO sit on the busiest instances: within each run, the
    correlation over its instances of the share of tokens past the SLO with the GPU busy share;
    the median over the runs that carry both."""
    def median_r(key: str) -> tuple[float, int] | None:
        rs = []
        for r in rows:
            x, slow = r.get(key), r.get("per_instance_slow_tpot")
            if isinstance(x, list) and isinstance(slow, list) and len(x) == len(slow) >= 3:
                try:
                    rs.append(statistics.correlation(x, slow))
                except statistics.StatisticsError:  # every instance alike
                    continue
        return (statistics.median(rs), len(rs)) if rs else None

    parts = [f"with {what}: median r {m[0]:+.2f} over {m[1]} runs"
             for key, what in (("per_instance_gpu_busy", "GPU busy"),
                               ("per_instance_mixed_share", "the GPU time in steps carrying prompt chunks"))
             if (m := median_r(key)) is not None]
    return "; within a run, over its instances, tokens past the TPOT SLO " + ", ".join(parts) if parts else ""


def _slow_tpot_line(rows: list[dict[str, Any]]) -> str:
    """Where the requests past the TPOT SLO lost their time: as the client timed them against as
    the engines did (rows that carry both)."""
    both = [r for r in rows if isinstance(r.get("slow_tpot_share"), float)
            and isinstance(r.get("engine_slow_tpot_share"), float)]
    if not both:
        return ""
    client = statistics.mean(r["slow_tpot_share"] for r in both)
    engine = statistics.mean(r["engine_slow_tpot_share"] for r in both)
    line = (f"; tokens of requests past the TPOT SLO, mean over {len(both)} runs: {client:.1%} as the client "
            f"timed them, {engine:.1%} as the engines did")
    waits = [r["slow_tpot_by_waits"] for r in both if isinstance(r.get("slow_tpot_by_waits"), float)]
    if waits:
        line += (f", of which {statistics.mean(waits):.1%} (mean over {len(waits)} runs) would have met it "
                 f"without their decodes' waits on other requests' loads and stores")
    return line


def _opt(v: float | None, fmt: str) -> str:
    """A table cell for a field older rows lack (blank, as wide as a value)."""
    width = int(fmt.split(".")[0] or 0)
    return format(v, fmt) if v is not None else " " * width


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(wls), figsize=(6.5 * len(wls), 4.5), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        routers = sorted({r["router"] for r in rows if r["workload"] == wl and not r["tuned"]})
        # and the best tuned peer configuration, where one ran (it may be the best peer of all)
        best = best_per_router(rows, wl)
        tuned = {r["router"] for r in rows if r["workload"] == wl and r["tuned"]}
        if tuned:
            routers.append(max(tuned, key=lambda k: best.get(k, 0.0)))
        if len(routers) > 10:  # more lines than the default cycle has colours
            ax.set_prop_cycle(color=[*plt.get_cmap("tab10").colors, *plt.get_cmap("Dark2").colors])
        for name in routers:
            mine = [r for r in rows if r["workload"] == wl and r["router"] == name]
            runs: dict[float, list[float]] = {}
            for r in mine:
                runs.setdefault(r["rate"], []).append(r["tps_slo"])
            rates = sorted(runs)
            style = "-o" if name.startswith("ours") else "--s"
            # the line through each load's mean; with repeats, every run as a faint dot
            line, = ax.plot(rates, [statistics.mean(runs[x]) for x in rates], style, label=name, ms=4)
            if any(len(v) > 1 for v in runs.values()):
                ax.plot([x for x in rates for _ in runs[x]], [y for x in rates for y in runs[x]], ".",
                        color=line.get_color(), alpha=0.35, ms=5)
        ax.set_title(f"{wl}")
        ax.set_xlabel("offered load (root sessions / s)")
        ax.set_ylabel("TPS within SLO (tokens / s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best", framealpha=0.6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_decode(rows: list[dict[str, Any]], path: Path) -> bool:
    """What slows the decodes, one dot per run: the engines' time per output token against the
    share of GPU time in steps that carried prompt chunks, and against the share spent waiting on
    loads and stores (the same axis, so the two slopes compare). False (no file) when fewer than
    five runs carry the fields."""
    have = [r for r in rows if all(isinstance(r.get(k), (int, float))
                                   for k in ("engine_itl_ms", "mixed_share", "stall_share"))]
    if len(have) < 5:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    for key, marker, what in (("mixed_share", "o", "in steps carrying prompt chunks"),
                              ("stall_share", "x", "waiting on loads and stores")):
        for family, colour in (("ours", "tab:blue"), ("peer", "tab:red")):
            mine = [r for r in have if r["router"].startswith("ours") == (family == "ours")]
            if mine:
                ax.plot([100 * r[key] for r in mine], [r["engine_itl_ms"] for r in mine], marker, color=colour,
                        alpha=0.7, label=f"{'ours' if family == 'ours' else 'peers'}: GPU time {what}")
    ax.set_xlabel("share of the engines' GPU time (%)")
    ax.set_ylabel("engines' time per output token (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best", framealpha=0.6)
    ax.set_title(f"what slows the decodes: {len(have)} runs, "
                 f"{', '.join(str(n) for n in sorted({r.get('instances', 0) for r in have}))} instances", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _loads(text: str) -> tuple[float, ...]:
    try:
        loads = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers, got {text!r}") from None
    if not loads or min(loads) <= 0:
        raise argparse.ArgumentTypeError(f"loads must be > 0, got {text!r}")
    return loads


def router_names(text: str) -> list[str]:
    """``--routers``' comma-separated names; a tuned configuration's own parameters are
    comma-separated inside its brackets (``vllm:cache_aware[cache-threshold=0.1,balance-abs-threshold=4]``)."""
    names: list[str] = []
    for part in re.split(r",(?![^\[]*\])", text):
        if part.strip():
            names.append(part.strip())
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="4 instances, Trace-1, 2 loads, defaults only (<= 8 min)")
    g.add_argument("--ci", action="store_true", help="the CI smoke: Trace-1 only, short runs")
    ap.add_argument("--instances", type=int, help="override the mode's cluster size (e.g. 32)")
    ap.add_argument("--latency-only", action="store_true", help="only the added-latency phase")
    ap.add_argument("--no-latency", action="store_true", help="skip the added-latency phase")
    ap.add_argument("--latency-pairs", type=int, help="routed and straight request pairs per router in the added-latency phase (each with a second straight request, the noise floor)")
    ap.add_argument("--gateway-tokenize", choices=("local", "engine"), default="local",
                    help="our gateway tokenizes with the mock's tokenizer directory (--tokenizer, as in front of "
                         "vLLM) or with an engine's /tokenize (a round trip per request)")
    ap.add_argument("--global-view", choices=("redis", "none"), default="redis",
                    help="(default: %(default)s) our controller follows the mock's global tier through a "
                         "redis-server per cluster, as it follows LMCache's redis connector; none: it does not see it")
    ap.add_argument("--max-output", type=int, help="cap every answer at this many tokens")
    ap.add_argument("--workloads", help="comma-separated workloads to run (trace1, weka; default: the mode's)")
    ap.add_argument("--sessions", type=int, help="root sessions replayed per run (overrides the mode's)")
    ap.add_argument("--loads", type=_loads, help="comma-separated offered loads, root sessions/s (overrides the mode's)")
    ap.add_argument("--weka-loads", type=_loads, help="the same for the WEKA sessions (overrides the mode's)")
    ap.add_argument("--routers", help="comma-separated subset of router names (e.g. ours:smetric,vllm:kv_aware)")
    ap.add_argument("--speed", type=float, help="the mock engines' speed against the profile (overrides the mode's)")
    ap.add_argument("--time-scale", type=float, help="scale think times by this (overrides the mode's)")
    ap.add_argument("--max-think", type=float, help="clip recorded think times here, s (overrides the mode's)")
    ap.add_argument("--tune", action="store_true", help="add the peers' tuning sweep (the full mode always runs it)")
    ap.add_argument("--tuned-only", action="store_true", help="run only the peers' tuned configurations")
    ap.add_argument("--arrival-window", type=float,
                    help="sessions per run = load x this many seconds (at least --sessions)")
    ap.add_argument("--plot", type=Path, help="write the TPS-vs-load plot here (PNG)")
    ap.add_argument("--rows", type=Path, help="write every run's row here (JSON lines)")
    ap.add_argument("--parallel", type=int, help="runs at once, each on its own cluster and router "
                                                 "(default: the mode's; WEKA's wait mostly on think and decode time)")
    ap.add_argument("--repeats", type=int, default=1, help="run every configuration's sweep this many times "
                                                           "(each load's figure: the mean of its runs)")
    ap.add_argument("--from-rows", type=Path, nargs="+", metavar="ROWS",
                    help="run nothing: report the rows of earlier --rows files (runs of one load averaged)")
    args = ap.parse_args(argv)
    # A stopped bench stops what it started: SIGTERM unwinds through the finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    mode = MODES["quick" if args.quick else "ci" if args.ci else "full"]
    if args.instances:
        mode.instances = args.instances
    if args.workloads:
        mode.workloads = tuple(w for w in ("trace1", "weka") if w in args.workloads.split(","))
        if not mode.workloads:
            print(f"live_peers: --workloads takes trace1 and/or weka, got {args.workloads!r}", file=sys.stderr)
            return 2
    if args.sessions:
        mode.sessions = mode.weka_sessions = args.sessions
    global GATEWAY_TOKENIZE, GLOBAL_VIEW
    GATEWAY_TOKENIZE = args.gateway_tokenize
    GLOBAL_VIEW = args.global_view
    if args.latency_pairs:
        mode.latency_requests = args.latency_pairs
    if args.no_latency:
        mode.latency_requests = 0
    mode.max_output = args.max_output
    if args.speed:
        mode.speed = args.speed
    if args.time_scale:
        mode.time_scale = args.time_scale
    if args.max_think:
        mode.max_think_s = args.max_think
    if args.parallel is not None:
        if args.parallel < 1:
            print("live_peers: --parallel takes a count >= 1", file=sys.stderr)
            return 2
        mode.parallel = args.parallel
        mode.weka_parallel = None
    if args.repeats < 1:
        print("live_peers: --repeats takes a count >= 1", file=sys.stderr)
        return 2
    if args.arrival_window:
        mode.arrival_window_s = args.arrival_window
    # The workload pool is sized by the mode's own loads, so --loads picks its sessions from the same
    # draw (a larger pool is another draw of the preset: different sessions at every load).
    pool = max(mode.sessions_at(r) for r in (*mode.loads, *([mode.pool_rate] if mode.pool_rate else ())))
    if args.loads:
        mode.loads = args.loads
    if args.weka_loads:
        mode.weka_loads = args.weka_loads
    if args.tune or args.tuned_only:
        mode.tune = True
    confs = default_confs() + (tuning_confs() if mode.tune else [])
    if mode.routers is not None and not args.routers:
        confs = [c for c in confs if c.name in mode.routers or c.tuned]
    if args.tuned_only:
        confs = [c for c in confs if c.tuned]
    if args.routers:
        want = set(router_names(args.routers))
        # a tuned configuration's name only exists with --tune: say so rather than run without it
        unknown = sorted(want - {n for c in confs for n in (c.name, f"{c.family}:{c.policy}")})
        if unknown:
            print(f"live_peers: --routers: no configuration named {', '.join(unknown)} in this run "
                  f"({'' if mode.tune else 'tuned ones need --tune; '}known: "
                  f"{', '.join(c.name for c in confs)})", file=sys.stderr)
            return 2
        confs = [c for c in confs if c.name in want or f"{c.family}:{c.policy}" in want]
    wls = {} if args.from_rows else load_workloads(mode.workloads, max(pool, *(mode.sessions_at(r) for r in mode.loads)))
    loads = {w: mode.loads_of(w) for w in mode.workloads}
    root = Path(tempfile.mkdtemp(prefix="live-peers-"))
    groups = [(c, w, (r,)) for w in mode.workloads for c in confs for r in loads[w]] if mode.fresh_per_load \
        else [(c, w, loads[w]) for w in mode.workloads for c in confs]
    groups *= args.repeats  # a repeat runs every configuration once before the next repeat
    rows: list[dict[str, Any]] = []
    if args.from_rows:
        try:
            rows = [json.loads(line) for f in args.from_rows for line in f.read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as exc:
            print(f"live_peers: --from-rows: {exc}", file=sys.stderr)
            return 2
        mode.workloads = tuple(w for w in ("trace1", "weka") if any(r.get("workload") == w for r in rows))
        sizes = {r["instances"] for r in rows if "instances" in r}
        if len(sizes) == 1:  # rows from before they carried it keep the mode's figure
            mode.instances = sizes.pop()
        elif len(sizes) > 1:  # the summary compares one cluster size: the one named, else the largest
            mode.instances = args.instances if args.instances in sizes else max(sizes)
            print(f"live_peers: --from-rows: rows of {len(sizes)} cluster sizes ({', '.join(map(str, sorted(sizes)))}); "
                  f"the summary is of the {mode.instances}-instance rows (--instances picks another), the line "
                  f"on what slows the decodes counts them all")
        mode.latency_requests = 0
    if args.latency_only or args.from_rows:
        groups = []
    n_runs = sum(len(r) for _, _, r in groups)
    lat_confs = [c for c in confs if not c.tuned]
    if not args.routers and not args.tuned_only:
        lat_confs += [c for c in default_confs() if c.name in mode.latency_routers and c not in lat_confs]
    if not mode.latency_requests:
        lat_confs = []
    total = n_runs + len(lat_confs)
    print(f"live_peers: {mode.instances} instances, {len(confs)} router configurations, workloads "
          f"{', '.join(mode.workloads)}, loads (root sessions/s) {loads}: {total} runs", flush=True)
    t0 = time.monotonic()
    _STOPPED.clear()
    done_lock = threading.Lock()
    k = 0

    not_run: list[str] = []

    def run_one(group: tuple[RouterConf, str, tuple[float, ...]]) -> None:
        nonlocal k
        conf, wl, rates = group
        try:
            got = run_group(conf, wl, wls[wl], rates, mode, root)
        except SweepStopped:
            with done_lock:
                not_run.extend(f"{conf.name} {wl} @ {r}/s" for r in rates)
            return
        except (RuntimeError, OSError) as exc:
            print(f"{conf.name} {wl}: FAILED: {exc}", flush=True)
            got = [{"router": conf.name, "family": conf.family, "policy": conf.policy, "tuned": conf.tuned,
                    "workload": wl, "rate": r, "requests": 0, "failed": -1, "tps_slo": 0.0, "ttft_p50": None,
                    "ttft_p99": None, "local_share": 0.0, "global_share": 0.0, "miss_share": 1.0,
                    "imbalance": 0.0, "router_cpu_ms_per_1k": 0.0, "counters": {}, "argv": [],
                    "error": str(exc)} for r in rates]
        with done_lock:
            for row in got:
                k += 1
                row["parallel"] = mode.parallel_of(wl)
                rows.append(row)
                if args.rows:
                    with args.rows.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                print(f"[{k}/{total}] {conf.name} {wl} @ {row['rate']}/s: TPS@SLO {row['tps_slo']:.0f}, "
                      f"{row['requests']} req ({row['failed']} failed), local {row['local_share']:.0%} "
                      f"global {row['global_share']:.0%}, imbalance {row['imbalance']:.2f}, "
                      f"late steps {row.get('late_steps', 0.0):.1%}, machine busy {row.get('machine_busy', 0.0):.0%}, "
                      f"per instance {row.get('per_instance_requests')}; router says {row['counters']}  "
                      f"[{time.monotonic() - t0:.0f} s]", flush=True)

    try:
        for wl in mode.workloads:
            mine = [g for g in groups if g[1] == wl]
            if mode.parallel_of(wl) <= 1:
                for g in mine:
                    run_one(g)
            else:  # each run's processes start from, and die with, the pool thread that runs it
                pool = ThreadPoolExecutor(mode.parallel_of(wl), thread_name_prefix=f"run-{wl}")
                try:
                    list(pool.map(run_one, mine))
                except BaseException:
                    # stopped early (SIGTERM, Ctrl-C): no run starts, and the running ones lose
                    # their clusters, so their replays fail at once instead of running to the end.
                    # Only then: the flag stops every later run too (the next workload's included).
                    pool.shutdown(wait=False, cancel_futures=True)
                    stop_live()
                    raise
                pool.shutdown()
        lat: dict[str, dict[str, float]] = {}
        for conf in lat_confs:
            k += 1
            try:
                lat[conf.name] = added_latency(conf, mode, root)
            except (RuntimeError, OSError) as exc:
                print(f"[{k}/{total}] latency {conf.name}: FAILED: {exc}", flush=True)
                continue
            a = lat[conf.name]
            print(f"[{k}/{total}] added latency {conf.name}: p50 {a['p50_ms']:.2f} ms, p90 {a['p90_ms']:.2f} ms, "
                  f"p99 {a['p99_ms']:.2f} ms over {a['pairs']:.0f} pairs (straight p50 {a['direct_p50_ms']:.2f} ms; "
                  f"the probe's own noise, straight minus straight: p50 {a['noise_p50_ms']:.2f}, "
                  f"p99 {a['noise_p99_ms']:.2f} ms; router CPU {a['router_cpu_ms_per_req']:.2f} ms per request; "
                  f"steal {a['steal']:.1%}, runnable {a['runnable']:.0f}, load {a['loadavg1']:.1f} on "
                  f"{os.cpu_count()} CPUs)" + _routing_note(a), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not_run:
        print(f"live_peers: {len(not_run)} runs never started (the sweep was stopped): {', '.join(not_run[:8])}"
              + (" ..." if len(not_run) > 8 else ""), flush=True)
    print()
    print(table(rows))
    if any(m["runs"] > 1 for m in load_means(rows)):
        print("\neach load's mean over its runs (the figures the summary below uses):")
        print(table(load_means(rows)))
    drivers = decode_drivers(rows)
    if drivers:
        print("\n" + drivers)
    print()
    print("command lines:")
    printed: set[str] = set()
    for r in rows:
        if r["argv"] and r["rate"] == rows[0]["rate"] and r["workload"] == rows[0]["workload"] \
                and r["router"] not in printed:
            printed.add(r["router"])
            print(f"  {r['router']}: " + " ; ".join(r["argv"]))
    ratio: dict[str, float] = {}
    sm_ratio: dict[str, float] = {}
    ours_best = best_peer = ""
    all_rows, rows = rows, [r for r in rows if r.get("instances", mode.instances) == mode.instances]
    for wl in mode.workloads:
        best = best_per_router(rows, wl)
        ours = {k: v for k, v in best.items() if k.startswith("ours:")}
        peers = {k: v for k, v in best.items() if not k.startswith("ours:")}
        if not ours or not peers:
            continue
        ob = max(ours, key=lambda k: ours[k])
        pb = max(peers, key=lambda k: peers[k])
        ours_best, best_peer = ob, pb
        ratio[wl] = ours[ob] / peers[pb] if peers[pb] > 0 else float("inf")
        # the paper's rule in whichever process layout ran (ours:smetric, ours:smetric[process=one])
        sm = max((v for k, v in ours.items() if k == "ours:smetric" or k.startswith("ours:smetric[")), default=0.0)
        sm_ratio[wl] = sm / peers[pb] if peers[pb] > 0 else float("inf")
        print(f"{wl}: ours best {ob} {ours[ob]:.0f} tok/s vs best peer {pb} {peers[pb]:.0f} tok/s -> "
              f"{ratio[wl]:.3f}x (smetric {sm_ratio[wl]:.3f}x)")
    cpu: dict[str, float] = {}
    for r in rows:
        if not r["tuned"] and r["requests"]:
            cpu.setdefault(r["router"], []).append(r["router_cpu_ms_per_1k"])  # type: ignore[attr-defined]
    cpu_ms = {k: round(statistics.median(v), 1) for k, v in cpu.items()}  # type: ignore[arg-type]
    if args.plot:
        plot(rows, args.plot, f"bench/live_peers.py {'--quick' if args.quick else '--ci' if args.ci else ''} "
                              f"({mode.instances} mock instances)")
        print(f"plot: {args.plot}")
        decode_path = args.plot.with_name(args.plot.stem + "_decode" + args.plot.suffix)
        if plot_decode(all_rows, decode_path):
            print(f"plot: {decode_path}")
    print(json.dumps({"instances": mode.instances, "workloads": list(mode.workloads), "ours_best": ours_best,
                      "best_peer": best_peer, "ours_vs_best_peer_tps_slo": {k: round(v, 3) for k, v in ratio.items()},
                      "smetric_vs_best_peer_tps_slo": {k: round(v, 3) for k, v in sm_ratio.items()},
                      "router_cpu_ms_per_1k": cpu_ms,
                      "router_added_latency_p99_ms": {k: round(v["p99_ms"], 2) for k, v in lat.items()},
                      "router_added_latency_p50_ms": {k: round(v["p50_ms"], 2) for k, v in lat.items()},
                      "latency_probe_noise_p99_ms": {k: round(v["noise_p99_ms"], 2) for k, v in lat.items()},
                      "peers_tuned": mode.tune}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
