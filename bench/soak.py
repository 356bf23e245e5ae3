"""Reliability soak: hostile peers, a long route load with and without done, faults, replicas.

    python bench/soak.py                                   # the issue's durations (~17 min here)
    python bench/soak.py --frames 5000 --soak-s 20 --no-done-s 10 --replica-s 3   # a smoke run

Phases, in order:

1. hostile storm: a ``ControllerApp`` (route socket, LMCache worker sockets, one KV-event
   subscriber) runs in this process with a loop-lag probe on its event loop; a second process
   plays the hostile peers: messages drawn from ``bench/kit/hostile.py`` (random, truncated, wrong
   types, deep nesting, huge lists, extreme integers, bad framing, protocol abuse) to the route
   ROUTER and the LMCache ROUTER (counting every reply), PUSHed to the LMCache PULL, and published
   as the engine the subscriber follows.
2. load soak on the same controller: an open-loop client process (bench/kit/soak_load.py) at the
   highest sustainable rate (``--rate``; 0: the closed-loop ceiling is measured first, then
   ``--probe-s`` probes at 50, 40, 30, 20 and 10% of it, highest first, and the first whose p99
   holds 5 ms is the rate: the highest rate that holds the latency target on this machine, whose
   vCPUs lose much of their time to the hypervisor once both are busy) for ``--soak-s`` with done reports, then
   ``--no-done-s`` without (in-flight entries then expire after ``load.lost_done_grace_s``),
   then ``--baseline-s`` of the same load with done against an echo server that does no routing
   (``soak_load.echo_server``): ``soak_p99_echo_baseline_ms`` is the latency this machine, ZMQ
   and the client alone give at that rate, the floor under ``soak_p99_ms``. Each phase reports
   its 10-s windows with the machine's steal; ``soak_p99_low_steal_ms`` is the p99 of the routes
   sent in windows where the hypervisor took under 5% of a CPU (``soak_low_steal_windows`` of
   them), the controller's latency when the machine gives it its CPUs.
   RSS growth and the worst loop stall cover phases 1-2. ``rss_growth_mb`` is what the soak
   leaves behind: read once the requests of the without-done minute have expired (the config
   holds each for ``load.lost_done_grace_s``, 30 s, by design: that state is bounded by rate x
   grace, not a leak) and after ``--settle-s`` idle (the controller returns freed memory to the
   OS every 5 s, see controller/memory.py). ``rss_growth_held_mb``, read right after the load
   with those entries still held, is printed too, with their count.
3. faults: ``bench/faults.py`` (stand-in engines, not vLLM; see its docstring): kill -9 of an
   engine under load (out / back times), kill -9 of the controller and a restart from its
   snapshot (first route time, index equal to the engine's truth); then a route socket with a
   CURVE allow-list and a client with a self-made keypair (must be refused).
4. replicas (bench/replicas.py): routes/s with 1, 2, 4 sharing replicas.

Prints a report, then ONE JSON line with the reliability issue's keys. ``malformed_frames``
counts what the controller received (its own counters), not what was sent;
``max_loop_stall_ms`` is the worst lateness of a 5 ms timer (wall time: on a shared machine
this includes the OS running other processes); ``max_loop_stall_loop_cpu_ms`` is how much of that
the loop's thread spent on CPU, ``max_loop_busy_ms`` the most CPU the loop's thread spent beyond
the period in any one timer wait (its own work, whatever the machine's load), and
``max_gc_pause_ms`` / ``max_gc_pause_cpu_ms`` the longest cyclic-GC pause, wall and CPU;
``max_loop_stall_trim_ms`` how long ``malloc_trim`` calls (controller/memory.py) overlapping
that stall took. The report's ``worst_stalls`` explains the five worst: loop CPU, the loop
thread's run-queue wait (the OS running other processes: on this bench's 2 shared cores, mostly
its own storm and load processes) and the rest (the thread asleep: a lock, a blocking call, or
its virtual CPU taken by the hypervisor: ``machine_steal_ms`` is the steal on all CPUs meanwhile);
``--sample-loop`` adds the system calls it was in. ``heap_mb`` shows where RSS sits (glibc in
use / free, pymalloc arenas against the blocks in use in them; see `bench/controller.py --probe inflight_bytes` for
why arenas outlive their blocks). Targets: >= 100,000 frames, 0 crashes, 0 unanswered, max stall
<= 50 ms, RSS growth <= 50 MB, dead engine out <= 1 s, back <= 2 s, first route <= 1 s after
restart, soak p99 <= 5 ms, routes/s growing with replicas.

Diagnosis (each slows the run a little; quote figures from runs without them):
``--slow-callbacks`` names the event-loop callbacks (by task) that ran over 15 ms and times the
load tracker's and the index's upkeep calls; ``--diag-end`` prints RSS after a full GC and a
``malloc_trim`` and a census of the live objects by pymalloc arena (``bench/kit/arena_census.py``:
which objects keep sparse arenas resident); ``--sample-loop`` and ``--tracemalloc`` as above.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import multiprocessing as mp
import random
import sys
import time
import tracemalloc
from multiprocessing.connection import Connection
from typing import Any

import replicas as replicas_bench  # noqa: E402  (bench/ is the script's directory)
import zmq
import zmq.asyncio
from kit import hostile, soak_load
from replicas import free_ports

from smetric_lmc.client import AsyncRouteClient
from smetric_lmc.config import AdvancedConfig, parse_config
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.controller.memory import ALLOCATORS, exec_with_allocator, running_allocator

END = ((1 << 64) - 1).to_bytes(8, "big")
SHARES = {"route": 0.4, "kv": 0.3, "lmcache_push": 0.2, "lmcache_request": 0.1}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# ---- the hostile peers (a separate process) --------------------------------------------------------


def _exchange(sock: zmq.Socket, messages: list[list[bytes]], bar: Any, window: int = 64) -> int:
    """Send in windows; returns the number of requests left unanswered (5 s per reply)."""
    unanswered = 0
    for start in range(0, len(messages), window):
        batch = messages[start : start + window]
        for m in batch:
            sock.send_multipart(m)
        for _ in batch:
            if sock.poll(5000):
                sock.recv_multipart()
            else:
                unanswered += 1
        bar.update(len(batch))
    return unanswered


def storm(endpoints: dict[str, str], n: int, huge_share: float, seed: int, conn: Connection) -> None:
    from tqdm import tqdm

    soak_load.lower_priority()  # the controller does not share cores with its attackers in production
    rng = random.Random(seed)
    ctx = zmq.Context()
    counts = {k: int(n * share) for k, share in SHARES.items()}
    out: dict[str, int] = {"unanswered": 0, **{f"sent_{k}": v for k, v in counts.items()}}
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # queue rather than drop: every frame should reach the subscriber
    pub.bind(endpoints["kv_pub"])
    replay = ctx.socket(zmq.ROUTER)
    replay.bind(endpoints["kv_replay"])
    conn.send("bound")
    pub.recv()  # the controller's subscription
    with tqdm(total=sum(counts.values()), desc="hostile messages", file=sys.stderr, mininterval=1.0) as bar:
        route = ctx.socket(zmq.DEALER)
        route.connect(endpoints["route"])
        msgs = [hostile.route_message(rng, k) for k in hostile.storm_kinds(rng, counts["route"], huge_share)]
        out["unanswered"] += _exchange(route, msgs, bar)
        lmc = ctx.socket(zmq.DEALER)
        lmc.connect(endpoints["lmcache_reply"])
        msgs = [hostile.lmcache_request(rng, k)
                for k in hostile.storm_kinds(rng, counts["lmcache_request"], huge_share)]
        out["unanswered"] += _exchange(lmc, msgs, bar)
        push = ctx.socket(zmq.PUSH)
        push.connect(endpoints["lmcache_pull"])
        for i, kind in enumerate(hostile.storm_kinds(rng, counts["lmcache_push"], huge_share)):
            push.send(hostile.lmcache_push(rng, kind))
            if i % 256 == 255:
                bar.update(256)
        for i, kind in enumerate(hostile.storm_kinds(rng, counts["kv"], huge_share)):
            pub.send_multipart(hostile.kv_message(rng, kind, b"kv", i))
            while replay.poll(0):  # nothing buffered: every replay ends at once
                ident, empty, *_ = replay.recv_multipart()
                replay.send_multipart([ident, empty, b"", END, b""])
            if i % 256 == 255:
                bar.update(256)
    conn.send(out)
    # Keep answering replays until told to stop, so the subscriber is never left waiting on us.
    while not conn.poll(0.01):
        while replay.poll(0):
            ident, empty, *_ = replay.recv_multipart()
            replay.send_multipart([ident, empty, b"", END, b""])
    ctx.destroy(linger=0)


# ---- the controller side ------------------------------------------------------------------------


class CrashCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.crashes = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "part crashed" in record.getMessage():
            self.crashes += 1


def _run_delay_reader() -> Any:
    """A reader of the calling thread's run-queue wait so far (s): the time the OS kept it ready
    but not running (``/proc/thread-self/schedstat``, field 2); a reader of 0.0 where absent."""
    import os

    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return lambda: 0.0
    return lambda: int(os.pread(fd, 128, 0).split()[1]) / 1e9


async def loop_lag(state: dict[str, Any], period_s: float = 0.005, top: int = 5) -> None:
    """Worst lateness of a timer on the loop (wall), and how much of it the loop's thread spent on
    CPU: on a shared machine a late timer can be the OS scheduling other processes, not loop work.
    ``state["worst"]`` keeps the ``top`` worst waits as (late, loop CPU, run-queue wait, start,
    end, phase, machine steal), times from ``perf_counter``, so :func:`explain_stalls` can say what
    they were: the loop's own work (CPU), the OS running something else (run-queue wait:
    preemption), or the thread asleep (the rest: a lock, the GIL held by another thread, a
    blocking call, or its virtual CPU descheduled by the hypervisor: the machine's steal then)."""
    worst: list[tuple[float, float, float, float, float, str, float]] = state.setdefault("worst", [])
    run_delay, steal = _run_delay_reader(), soak_load.steal_reader()
    while True:
        t0, c0, q0, phase = time.perf_counter(), time.thread_time(), run_delay(), state.get("phase", "")
        s0 = steal()
        await asyncio.sleep(period_s)
        t1 = time.perf_counter()
        late, cpu = t1 - t0 - period_s, time.thread_time() - c0
        if late > state["max"]:
            state["max"] = late
            state["max_cpu"] = cpu
        if len(worst) < top or late > worst[-1][0]:
            worst.append((late, cpu, run_delay() - q0, t0, t1, phase, steal() - s0))
            worst.sort(reverse=True)
            del worst[top:]
        state["max_busy"] = max(state.get("max_busy", 0.0), cpu - period_s)


def sample_syscalls(tid: int, conn: Connection, period_s: float = 0.001) -> None:
    """Diagnosis (``--sample-loop``), in its own process: every ``period_s`` read which system
    call the loop's thread ``tid`` is in (``/proc/<tid>/syscall``: 232 epoll_wait is idle, 202
    futex a lock or the GIL, "running" on CPU), kept as (perf_counter, call) when it changes;
    sends the list when told to stop."""
    path = f"/proc/{tid}/syscall"
    seen: list[tuple[float, str]] = []
    last = ""
    while not conn.poll(0):
        try:
            with open(path) as f:
                now = f.read().split()
        except OSError:
            break
        call = now[0] if now else "?"
        if call == "202":
            call = f"futex {now[1]} op {now[2]}"  # the lock's address tells the GIL from malloc's
        elif call == "7":  # poll: on which file, with which timeout
            call = f"poll {_polled_fd(tid, int(now[1], 16))} nfds {int(now[2], 16)} timeout {int(now[3], 16)}"
        if call != last:
            seen.append((time.perf_counter(), call))
            last = call
        time.sleep(period_s)
    conn.send(seen)


def _polled_fd(tid: int, pollfds: int) -> str:
    """What the first ``struct pollfd`` at ``pollfds`` in thread ``tid``'s memory refers to."""
    import os

    try:
        with open(f"/proc/{tid}/mem", "rb") as mem:
            mem.seek(pollfds)
            fd = int.from_bytes(mem.read(4), "little", signed=True)
        return f"fd {fd} -> {os.readlink(f'/proc/{tid}/fd/{fd}')}"
    except (OSError, ValueError) as exc:
        return f"? ({type(exc).__name__})"


def calls_during(samples: list[tuple[float, str]], t0: float, t1: float) -> dict[str, float]:
    """ms the sampled thread spent in each call within ``[t0, t1]``."""
    out: dict[str, float] = {}
    for (ta, call), (tb, _) in zip(samples, [*samples[1:], (float("inf"), "")]):
        a, b = max(ta, t0), min(tb, t1)
        if b > a:
            out[call] = round(out.get(call, 0.0) + (b - a) * 1000, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:4])


def explain_stalls(worst: list[tuple[float, float, float, float, float, str, float]], trimmer: Any,
                   samples: list[tuple[float, str]] | None = None) -> list[dict[str, Any]]:
    """The worst timer waits: wall late, the loop thread's CPU and run-queue wait meanwhile (see
    :func:`loop_lag`), the machine's steal meanwhile (10 ms ticks, all CPUs), the bench step then,
    and the ``malloc_trim`` calls (controller/memory.py) that overlapped them, with their durations."""
    out = []
    for late, cpu, queued, t0, t1, phase, stolen in worst:
        trims = trimmer.overlapping(t0, t1)
        out.append({"late_ms": round(late * 1000, 1), "loop_cpu_ms": round(cpu * 1000, 1),
                    "run_queue_ms": round(queued * 1000, 1), "machine_steal_ms": round(stolen * 1000),
                    "phase": phase,
                    "trims_overlapping_ms": [round((b - a) * 1000, 1) for a, b in trims]})
        if samples:
            out[-1]["syscalls_ms"] = calls_during(samples, t0, t1)
    return out


def watch_slow_callbacks(keep_over_s: float = 0.015) -> list[tuple[float, str, str]]:
    """Diagnosis: time every event-loop callback; returns the list it fills with (seconds, phase
    unknown here so wall time, callback) for those over ``keep_over_s``. ~1 us per callback."""
    import asyncio.events

    slow: list[tuple[float, str, str]] = []
    run = asyncio.events.Handle._run

    def timed(self: Any) -> None:
        t0 = time.perf_counter()
        run(self)
        d = time.perf_counter() - t0
        if d > keep_over_s:
            task = getattr(self._callback, "__self__", None)
            what = repr(self)[:200]
            if isinstance(task, asyncio.Task):
                coro = task.get_coro()
                what = f"task {task.get_name()} {getattr(coro, '__qualname__', coro)}"
            slow.append((round(d * 1000, 1), time.strftime("%H:%M:%S"), what))

    asyncio.events.Handle._run = timed  # type: ignore[method-assign]
    return slow


def time_calls(slow: list[tuple[float, str, str]], obj: Any, *names: str, over_s: float = 0.008) -> None:
    """Diagnosis: wrap ``obj``'s methods ``names`` so calls over ``over_s`` join ``slow``."""
    for name in names:
        method = getattr(obj, name)

        def timed(*a: Any, _m: Any = method, _n: str = f"{type(obj).__name__}.{name}", **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _m(*a, **kw)
            finally:
                d = time.perf_counter() - t0
                if d > over_s:
                    slow.append((round(d * 1000, 1), time.strftime("%H:%M:%S"), _n))

        setattr(obj, name, timed)


def heap_mb() -> dict[str, float]:
    """glibc heap (in use, free) and pymalloc arenas, in MB: where RSS sits."""
    from smetric_lmc.controller.memory import heap_info

    out: dict[str, float] = {}
    info = heap_info()
    if info is not None:
        out.update(malloc_used=info["uordblks"] / 2**20, malloc_free=info["fordblks"] / 2**20,
                   malloc_mmapped=info["hblkhd"] / 2**20)
    arenas, used = pymalloc_stats()
    out.update(pymalloc_arenas=arenas / 2**20, pymalloc_used=used / 2**20)
    return {k: round(v, 1) for k, v in out.items()}


def pymalloc_stats() -> tuple[int, int]:
    """pymalloc's (bytes in arenas, bytes in allocated blocks) now, from its own statistics
    (``sys._debugmallocstats`` writes them to the C-level stderr, captured through a temp file):
    arenas far above the blocks in them is fragmentation (an arena is freed only when empty)."""
    import os
    import re
    import tempfile

    with tempfile.TemporaryFile("w+") as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    got = [re.search(pat, text) for pat in (r"arenas \* \d+ bytes/arena\s*=\s*([\d,]+)",
                                            r"# bytes in allocated blocks\s*=\s*([\d,]+)")]
    arenas, used = (int(m.group(1).replace(",", "")) if m else -1 for m in got)
    return arenas, used


def gc_pauses(state: dict[str, float]) -> None:
    """Record the longest cyclic-GC pause, wall (``gc_max``, also per generation) and CPU of the
    collecting thread (``gc_max_cpu``): on a shared machine the wall figure includes preemption."""
    t: list[float] = [0.0, 0.0]

    def cb(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            t[0], t[1] = time.perf_counter(), time.thread_time()
        else:
            took = time.perf_counter() - t[0]
            state["gc_max"] = max(state.get("gc_max", 0.0), took)
            state["gc_max_cpu"] = max(state.get("gc_max_cpu", 0.0), time.thread_time() - t[1])
            key = f"gc_max_gen{info['generation']}"
            state[key] = max(state.get(key, 0.0), took)

    gc.callbacks.append(cb)


def gc_census(top: int = 8) -> dict[str, Any]:
    """Objects the cyclic GC tracks outside the frozen generation, by type (what a full
    collection walks), and how many are frozen."""
    counts: dict[str, int] = {}
    for gen in range(3):
        for o in gc.get_objects(gen):
            name = type(o).__name__
            counts[name] = counts.get(name, 0) + 1
    return {"tracked": sum(counts.values()), "frozen": gc.get_freeze_count(),
            "top": dict(sorted(counts.items(), key=lambda kv: -kv[1])[:top])}


def received(app: ControllerApp) -> dict[str, int]:
    lmc = app.lmcache_server.stats
    sub = app.subscribers["a"].stats
    return {
        "route": app.service.counters["frames"],
        "lmcache": lmc["pull_frames"] + lmc["router_frames"],
        "kv": sub.batches + sub.decode_errors + sub.bad_frames + sub.other_topic + sub.oversize_batches
        + sub.duplicates,
    }


async def _in_child(lag: dict[str, Any], label: str, target: Any, *args: Any) -> Any:
    """Run ``target(*args, conn)`` in a spawned process and return what it sends; ``lag["phase"]``
    names the step, for :func:`explain_stalls`."""
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=target, args=(*args, child))
    loop = asyncio.get_running_loop()
    # Start and join off the loop: join waits in poll() on the child's sentinel while the child
    # shuts down (seen: 50-230 ms with the loop's thread asleep, the soak's worst "stall").
    lag["phase"] = f"{label}:start"
    await loop.run_in_executor(None, proc.start)
    try:
        lag["phase"] = f"{label}:run"
        return await loop.run_in_executor(None, parent.recv)
    finally:
        lag["phase"] = f"{label}:join"
        await loop.run_in_executor(None, proc.join, 30)
        lag["phase"] = "idle"


#: Fractions of the closed-loop ceiling probed, highest first, for the soak's rate (--rate 0).
RATE_FRACTIONS = (0.5, 0.4, 0.3, 0.2, 0.1)
P99_TARGET_MS = 5.0


async def load_soak(app: ControllerApp, args: argparse.Namespace, lag: dict[str, Any]) -> dict[str, Any]:
    endpoint = app.service.endpoint or ""
    ceiling = await _in_child(lag, "calibrate", soak_load.calibrate, endpoint, args.calibrate_s, 16)
    probes: list[dict[str, float]] = []
    rate = args.rate
    if not rate:
        # The highest rate that holds the latency target: the first fraction of the ceiling, from
        # the top, whose probe meets it (the lowest probed if none does; the report says so).
        for fraction in RATE_FRACTIONS:
            rate = max(50.0, round(ceiling * fraction))
            got = await _in_child(lag, "rate_probe", soak_load.load_client, endpoint, rate, args.probe_s, True)
            steal = [w["steal_pct"] for w in got["windows"] if w["steal_pct"] == w["steal_pct"]]
            probes.append({"rate": rate, "p99_ms": got["p99_ms"],
                           "steal_pct": round(sum(steal) / len(steal), 1) if steal else None})
            if got["p99_ms"] <= P99_TARGET_MS:
                break
        print(f"soak rate probes: {probes}", file=sys.stderr)
    phases = {}
    for name, seconds, done in (("with_done", args.soak_s, True), ("without_done", args.no_done_s, False)):
        if seconds <= 0:
            continue
        print(f"soak {name}: {rate:.0f} routes/s for {seconds:.0f} s", file=sys.stderr)
        phases[name] = await _in_child(lag, name, soak_load.load_client, endpoint, rate, seconds, done)
        phases[name]["in_flight_after"] = len(app.load)
        phases[name]["windows"] = tail_windows(phases[name].pop("windows"))
    if args.baseline_s > 0:
        print(f"soak echo_baseline: {rate:.0f} routes/s for {args.baseline_s:.0f} s", file=sys.stderr)
        phases["echo_baseline"] = await echo_baseline(lag, rate, args.baseline_s)
    return {"ceiling_routes_per_s": round(ceiling), "rate": rate, "rate_probes": probes, "phases": phases}


def tail_windows(windows: list[dict[str, float]], over_ms: float = 5.0) -> dict[str, Any]:
    """Where a phase's tail came from: of its ``soak_load.WINDOW_S`` windows, how many had a p99
    over ``over_ms``, the machine's mean steal in those and in the others (% of one CPU), and the
    three worst."""
    def mean(xs: list[float]) -> float | None:
        xs = [x for x in xs if x == x]  # NaN: no steal reading for that window
        return round(sum(xs) / len(xs), 1) if xs else None

    slow = [w for w in windows if w["p99_ms"] > over_ms]
    fast = [w for w in windows if w["p99_ms"] <= over_ms]
    return {"count": len(windows), f"p99_over_{over_ms:g}ms": len(slow),
            "steal_pct_slow": mean([w["steal_pct"] for w in slow]),
            "steal_pct_other": mean([w["steal_pct"] for w in fast]),
            "worst": sorted(windows, key=lambda w: -w["p99_ms"])[:3]}


async def echo_baseline(lag: dict[str, Any], rate: float, seconds: float) -> dict[str, Any]:
    """The same load with done against ``soak_load.echo_server`` (no routing work): the latency
    this machine, ZMQ and the client give any server at this rate (the controller idles meanwhile)."""
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=soak_load.echo_server, args=(child,))
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, proc.start)
    try:
        endpoint = await loop.run_in_executor(None, parent.recv)
        out = await _in_child(lag, "echo_baseline", soak_load.load_client, endpoint, rate, seconds, True)
        out["windows"] = tail_windows(out.pop("windows"))
        return out
    finally:
        parent.send("stop")
        await loop.run_in_executor(None, proc.join, 10)


def faults(args: argparse.Namespace) -> dict[str, Any]:
    """bench/faults.py (dead engine out/back, controller kill -9 and restart) and the CURVE check."""
    out: dict[str, Any] = {"faults": None, "faults_skipped": "--no-faults" if args.no_faults else None}
    if not args.no_faults:
        import faults as faults_bench  # bench/faults.py

        try:
            out["faults"] = asyncio.run(faults_bench.measure(poll_s=args.poll_s))
        except Exception as exc:  # reported as null with the reason, never as a number
            out["faults_skipped"] = f"{type(exc).__name__}: {exc}"
    try:
        out["curve_unknown_client_refused"] = curve_refuses_unknown_client()
    except Exception as exc:
        out["curve_unknown_client_refused"] = None
        out["curve_error"] = f"{type(exc).__name__}: {exc}"
    return out


def curve_refuses_unknown_client() -> bool:
    from kit.route_core import make_core

    from smetric_lmc.client import RouteClient, RouteRefused
    from smetric_lmc.controller.service import RouteCore, RouteService

    public, secret = (k.decode() for k in zmq.curve_keypair())
    known_pub, known_sec = (k.decode() for k in zmq.curve_keypair())
    core: RouteCore = make_core()

    async def go() -> bool:
        svc = RouteService(core, "tcp://127.0.0.1:*", curve_secret_key=secret, curve_public_key=public,
                           curve_client_keys=[known_pub], ctx=zmq.asyncio.Context())
        endpoint = svc.bind()
        task = asyncio.create_task(svc.run())
        loop = asyncio.get_running_loop()

        def clients() -> bool:
            # Both clients stay open together: HandshakeWatch names its inproc monitor by id(),
            # which a second client created after the first is freed may reuse (address in use).
            with RouteClient(endpoint, curve_server_key=public, curve_public_key=known_pub,
                             curve_secret_key=known_sec, timeout_s=3.0) as c:
                known_ok = c.health().ok
                try:
                    with RouteClient(endpoint, curve_server_key=public, timeout_s=2.0) as stranger:
                        stranger.health()
                    return False
                except RouteRefused:
                    return known_ok

        try:
            return await loop.run_in_executor(None, clients)
        finally:
            await svc.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    return asyncio.run(go()) and core.counters["health"] == 1


async def run(args: argparse.Namespace) -> dict[str, Any]:
    pub_port, replay_port = free_ports(2)
    cfg = hostile.target_config("soak", 16, pub_port, replay_port)
    if args.worker_timeout_s is not None:  # diagnosis: let the storm's LMCache workers expire within a short run
        cfg["advanced"] = {"limits": {"lmcache_worker_timeout_s": args.worker_timeout_s}}
    crashes = CrashCounter()
    logging.getLogger().addHandler(crashes)
    logging.getLogger("smetric_lmc").setLevel(logging.ERROR)  # a storm logs a warning per bad gap
    endpoints = {"kv_pub": f"tcp://127.0.0.1:{pub_port}", "kv_replay": f"tcp://127.0.0.1:{replay_port}"}
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    # The engine side binds first so the subscriber's connect finds it.
    proc = None
    app: ControllerApp | None = None
    lag: dict[str, Any] = {"max": 0.0}
    elapsed = 0.0
    try:
        app = ControllerApp(parse_config(cfg), enable_metrics_http=False)
        if args.trim_min_free_mb is not None:
            app.trimmer.min_free = int(args.trim_min_free_mb * 2**20)
        await app.start()
        endpoints.update(route=app.service.endpoint or "", lmcache_pull=app.lmcache_server.endpoints["pull"],
                         lmcache_reply=app.lmcache_server.endpoints["reply"])
        proc = spawn.Process(target=storm, args=(endpoints, args.frames, args.huge_share, args.seed, child))
        proc.start()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, parent.recv)  # "bound"
        await asyncio.sleep(0.5)  # warm-up: the subscription reaches the peer
        rss0, heap0 = rss_mb(), heap_mb()
        if args.tracemalloc:
            tracemalloc.start(args.tracemalloc)
            snap0 = tracemalloc.take_snapshot()
        gc_pauses(lag)
        lag["phase"] = "storm"
        sampler = None
        slow = watch_slow_callbacks() if args.slow_callbacks else None
        if slow is not None:  # which upkeep step a slow index-maintain turn was
            time_calls(slow, app.load, "expire", "drain", "_compact")
            time_calls(slow, app.index, "maintain", "expire")
            time_calls(slow, app.index._tree, "sweep")
            time_calls(slow, app.index._pending, "expire", "_maybe_compact")
            time_calls(slow, app.index._orphans, "expire")
        if args.sample_loop:
            import threading

            sampler_conn, sampler_child = spawn.Pipe()
            sampler = spawn.Process(target=sample_syscalls, args=(threading.get_native_id(), sampler_child))
            sampler.start()
        lag_task = asyncio.create_task(loop_lag(lag))
        t0 = time.perf_counter()
        result = await loop.run_in_executor(None, parent.recv)
        # Let the controller drain what is queued (KV events, PULL frames).
        last, stable_since = received(app), time.perf_counter()
        while time.perf_counter() - stable_since < 2.0:
            await asyncio.sleep(0.2)
            now = received(app)
            if now != last:
                last, stable_since = now, time.perf_counter()
        elapsed = time.perf_counter() - t0 - 2.0
        lag["phase"] = "after storm"
        got = received(app)  # before the valid route below adds one
        unanswered = result["unanswered"]
        try:
            async with AsyncRouteClient(app.service.endpoint or "", timeout_s=5.0) as client:
                d = await client.route("after-storm", token_ids=list(range(64)), turn=0)
                valid_after = d.instance_id is not None
        except Exception:
            valid_after = False
        if not valid_after:
            unanswered += 1
        storm_loop = {k: round(v * 1000, 1) for k, v in lag.items() if isinstance(v, float)}
        rss_storm = rss_mb()
        soak = await load_soak(app, args, lag)
        unanswered += sum(r["unanswered"] for r in soak["phases"].values())
        rss_held, held, heap_held = rss_mb(), len(app.load), heap_mb()
        if args.tracemalloc:
            print("-- held vs start --", file=sys.stderr)
            for stat in tracemalloc.take_snapshot().compare_to(snap0, "lineno")[:12]:
                print(stat, file=sys.stderr)
            print("-- end vs start --", file=sys.stderr)
        grace = app.cfg.load.lost_done_grace_s or 0.0
        give_up = time.perf_counter() + grace + 10.0
        lag["phase"] = "expiry"
        while len(app.load) and time.perf_counter() < give_up:  # the lost requests expire
            await asyncio.sleep(0.5)
        lag["phase"] = "settle"
        await asyncio.sleep(args.settle_s)  # idle: the controller's periodic malloc_trim runs
        lag_task.cancel()
        rss1, heap1 = rss_mb(), heap_mb()
        if args.diag_end:  # diagnosis only, after the reading above: what a collection and a trim give back
            gc.collect()
            diag = {"after_gc": (round(rss_mb(), 1), heap_mb())}
            from smetric_lmc.controller.memory import malloc_trim

            malloc_trim()
            diag["after_trim"] = (round(rss_mb(), 1), heap_mb())
            print(f"diag_end: {diag}", file=sys.stderr)
            from kit.arena_census import census

            print(f"arena_census: {json.dumps(census(), default=str)}", file=sys.stderr)
        if slow is not None:
            print(f"slow_callbacks: {sorted(slow, reverse=True)[:8]}", file=sys.stderr)
        samples = None
        if sampler is not None:
            sampler_conn.send("stop")
            samples = sampler_conn.recv()
            sampler.join(10)
        if args.tracemalloc:
            grown = tracemalloc.take_snapshot().compare_to(snap0, "traceback" if args.tracemalloc > 1 else "lineno")
            tracemalloc.stop()
            for stat in grown[:15]:
                print(stat, file=sys.stderr)
                if args.tracemalloc > 1:
                    print("    " + "\n    ".join(stat.traceback.format()[-2 * args.tracemalloc:]), file=sys.stderr)
        census = gc_census()
        state = {"index": {**app.index.sizes()}, "in_flight": len(app.load),
                 "lmcache_workers": len(app.lmcache_server.workers()), "load": dict(app.load.stats)}
        dead = [t.get_name() for t in app._tasks if t.done()]
        internal = app.core.counters["internal_errors"] + app.lmcache_server.stats["internal_errors"] + sum(
            s.stats.internal_errors for s in app.subscribers.values())
        with_done = soak["phases"]["with_done"]
        return {
            "sent": {k: v for k, v in result.items() if k.startswith("sent_")},
            "received": got,
            "storm_elapsed_s": round(elapsed, 1),
            "storm_loop_ms": storm_loop,
            "soak": soak,
            "loop_ms": {k: round(v * 1000, 1) for k, v in lag.items() if isinstance(v, float)},
            "worst_stalls": explain_stalls(lag.get("worst", []), app.trimmer, samples),
            "malloc_trim": {k: round(v, 1) for k, v in app.trimmer.stats.items()},
            "heap_mb": {"start": heap0, "held": heap_held, "end": heap1},
            "rss_mb": {"start": round(rss0, 1), "after_storm": round(rss_storm, 1), "held": round(rss_held, 1), "in_flight_held": held,
                       "end": round(rss1, 1)},
            "gc_after": census,
            "service": dict(app.service.counters),
            "state_after": state,
            "valid_route_after_storm": valid_after,
            "dead_parts": dead,
            "internal_errors": internal,
            "errors_by_code": dict(app.core.errors_by_code),
            "lmcache": {k: app.lmcache_server.stats[k] for k in ("decode_errors", "workers_refused", "oversize_frames")},
            "kv": {k: getattr(app.subscribers["a"].stats, k) for k in ("decode_errors", "bad_frames",
                                                                        "oversize_batches", "unfilled_gaps",
                                                                        "offloaded", "large_on_loop", "worker_failures")},
            "json": {
                "malformed_frames": sum(got.values()),
                "controller_crashes": crashes.crashes + len(dead),
                "unanswered_requests": unanswered,
                "max_loop_stall_ms": round(lag["max"] * 1000, 1),
                # What the loop's own work cost: its thread's CPU during that worst stall, and the
                # most CPU it spent beyond the timer's period in any one wait; GC pause wall/CPU.
                "max_loop_stall_loop_cpu_ms": round(lag.get("max_cpu", 0.0) * 1000, 1),
                "max_loop_stall_trim_ms": sum(explain_stalls(lag.get("worst", [])[:1], app.trimmer)[0]["trims_overlapping_ms"])
                if lag.get("worst") else 0.0,
                "max_loop_busy_ms": round(lag.get("max_busy", 0.0) * 1000, 1),
                "max_gc_pause_ms": round(lag.get("gc_max", 0.0) * 1000, 1),
                "max_gc_pause_cpu_ms": round(lag.get("gc_max_cpu", 0.0) * 1000, 1),
                "rss_growth_mb": round(rss1 - rss0, 1),
                "rss_growth_held_mb": round(rss_held - rss0, 1),
                "allocator": running_allocator(),
                "soak_routes_per_s": with_done["routes_per_s"],
                "soak_p99_ms": with_done["p99_ms"],
                "soak_p99_echo_baseline_ms": soak["phases"].get("echo_baseline", {}).get("p99_ms"),
                # The soak's routes sent in 10-s windows of under 5% steal, and how many windows.
                "soak_p99_low_steal_ms": with_done["low_steal"]["p99_ms"],
                "soak_low_steal_windows": f'{with_done["low_steal"]["windows"]}/{with_done["windows"]["count"]}',
            },
        }
    finally:
        if proc is not None:
            parent.send("stop")
            proc.join(10)
        if app is not None:
            await app.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=100_000, help="malformed messages in total")
    p.add_argument("--huge-share", type=float, default=0.002, help="share of huge messages (MBs each)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--soak-s", type=float, default=600.0, help="route load with done reports")
    p.add_argument("--no-done-s", type=float, default=60.0, help="route load without done reports")
    p.add_argument("--rate", type=float, default=0.0,
                   help="routes/s of the soak (0: the highest of 50, 40, 30, 20, 10%% of the measured ceiling "
                        "whose --probe-s probe holds p99 <= 5 ms)")
    p.add_argument("--probe-s", type=float, default=10.0, help="seconds per rate probe")
    p.add_argument("--calibrate-s", type=float, default=5.0)
    p.add_argument("--baseline-s", type=float, default=60.0,
                   help="the same load with done against an echo server (no routing): the machine's floor")
    p.add_argument("--settle-s", type=float, default=6.0, help="idle time before the final RSS reading")
    p.add_argument("--no-faults", action="store_true", help="skip the dead-engine and restart figures (bench/faults.py)")
    p.add_argument("--poll-s", type=float, default=1.0, help="bench/faults.py: the controller's engine /metrics poll")
    p.add_argument("--trim-min-free-mb", type=float, default=None,
                   help="the controller's malloc_trim gate (controller/memory.py); 0 trims every period")
    p.add_argument("--sample-loop", action="store_true",
                   help="diagnosis: a process samples the loop thread's system call every ms (see worst_stalls)")
    p.add_argument("--diag-end", action="store_true",
                   help="diagnosis: after the final RSS reading, print RSS after a full GC and after a malloc_trim")
    p.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                   help="diagnosis: trace Python allocations (slow) and print the top growth by line")
    p.add_argument("--slow-callbacks", action="store_true",
                   help="diagnosis: report the event-loop callbacks that ran over 15 ms (printed at the end)")
    p.add_argument("--worker-timeout-s", type=float, default=None,
                   help="limits.lmcache_worker_timeout_s (default: the config's); a short one lets a smoke run see them expire")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--replica-s", type=float, default=10.0, help="seconds per replica count")
    p.add_argument("--allocator", choices=ALLOCATORS, default=AdvancedConfig().allocator,
                   help="run under this allocator, as `smetric controller` does with advanced.allocator "
                        "(default: the config default)")
    args = p.parse_args()
    exec_with_allocator(args.allocator)  # returns once running under it
    out = asyncio.run(run(args))
    f = faults(args)
    rows = replicas_bench.measure(args.replicas, args.replica_s)
    report = {k: v for k, v in out.items() if k != "json"}
    report.update(f)
    report["replicas"] = rows
    for k, v in report.items():
        print(f"{k}: {v}")
    fault_keys = ("dead_engine_out_s", "engine_back_s", "restart_index_equal", "restart_first_route_s")
    print(json.dumps({
        **out["json"],
        **{k: (f["faults"] or {}).get(k) for k in fault_keys},
        "replicas_routes_per_s": [r["routes_per_s"] for r in rows],
        "curve_unknown_client_refused": f["curve_unknown_client_refused"],
    }))


if __name__ == "__main__":
    main()
