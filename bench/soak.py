"""Hostile-peer soak: malformed messages on every peer-facing socket of a running controller.

    python bench/soak.py                      # 100,000 malformed messages (several minutes here)
    python bench/soak.py --frames 5000        # a smoke run

A ``ControllerApp`` (route socket, LMCache worker sockets, one KV-event subscriber) runs in this
process with a loop-lag probe on its event loop; a second process plays the hostile peers: it
sends messages drawn from ``smetric_lmc.hostile`` (random, truncated, wrong types, deep nesting,
huge lists, extreme integers, bad framing, protocol abuse) to the route ROUTER and the LMCache
ROUTER (counting every reply), PUSHes them to the LMCache PULL, and publishes them as the engine
the subscriber follows. Afterwards a valid route must succeed.

Prints a report, then ONE JSON line with the keys of the reliability issue this run measures:
``{"malformed_frames", "controller_crashes", "unanswered_requests", "max_loop_stall_ms",
"rss_growth_mb"}``. ``malformed_frames`` counts what the controller received (its own counters),
not what was sent. Targets: >= 100,000 frames, 0 crashes, 0 unanswered, max stall <= 50 ms,
RSS growth <= 50 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import logging
import multiprocessing as mp
import random
import socket
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import zmq
import zmq.asyncio

from smetric_lmc import hostile
from smetric_lmc.client import AsyncRouteClient
from smetric_lmc.config import parse_config
from smetric_lmc.controller.app import ControllerApp

END = ((1 << 64) - 1).to_bytes(8, "big")
SHARES = {"route": 0.4, "kv": 0.3, "lmcache_push": 0.2, "lmcache_request": 0.1}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _malloc_trim() -> bool:
    """Ask glibc to return freed heap pages: tells retained garbage from live state."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0) or True)
    except OSError:
        return False


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


async def loop_lag(state: dict[str, float], period_s: float = 0.005) -> None:
    """Worst lateness of a timer on the loop (wall), and how much of it the loop's thread spent on
    CPU: on a shared machine a late timer can be the OS scheduling other processes, not loop work."""
    while True:
        t0, c0 = time.perf_counter(), time.thread_time()
        await asyncio.sleep(period_s)
        late = time.perf_counter() - t0 - period_s
        if late > state["max"]:
            state["max"] = late
            state["max_cpu"] = time.thread_time() - c0
        state["max_busy"] = max(state.get("max_busy", 0.0), time.thread_time() - c0 - period_s)


def gc_pauses(state: dict[str, float]) -> None:
    t: list[float] = [0.0]

    def cb(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            t[0] = time.perf_counter()
        else:
            state["gc_max"] = max(state.get("gc_max", 0.0), time.perf_counter() - t[0])

    gc.callbacks.append(cb)


def received(app: ControllerApp) -> dict[str, int]:
    lmc = app.lmcache_server.stats
    sub = app.subscribers["a"].stats
    return {
        "route": app.service.counters["frames"],
        "lmcache": lmc["pull_frames"] + lmc["router_frames"],
        "kv": sub.batches + sub.decode_errors + sub.bad_frames + sub.other_topic + sub.oversize_batches
        + sub.duplicates,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    pub_port, replay_port = free_ports(2)
    cfg = {
        "model": "soak",
        "hashing": {"block_size": 16},
        "instances": [
            {"id": "a", "http": "http://127.0.0.1:9", "kv_events": f"tcp://127.0.0.1:{pub_port}",
             "replay": f"tcp://127.0.0.1:{replay_port}"},
            {"id": "b", "http": "http://127.0.0.1:10"},
        ],
        "server": {"route_url": "tcp://127.0.0.1:*", "metrics_port": 0},
        "load": {"metrics_poll_s": 0, "instance_timeout_s": 0},
        "lmcache": {"enabled": True, "pull_url": "tcp://127.0.0.1:*", "reply_url": "tcp://127.0.0.1:*"},
    }
    crashes = CrashCounter()
    logging.getLogger().addHandler(crashes)
    logging.getLogger("smetric_lmc").setLevel(logging.ERROR)  # a storm logs a warning per bad gap
    endpoints = {"kv_pub": f"tcp://127.0.0.1:{pub_port}", "kv_replay": f"tcp://127.0.0.1:{replay_port}"}
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    # The engine side binds first so the subscriber's connect finds it.
    proc = None
    app: ControllerApp | None = None
    lag = {"max": 0.0}
    try:
        app = ControllerApp(parse_config(cfg), enable_metrics_http=False)
        await app.start()
        endpoints.update(route=app.service.endpoint or "", lmcache_pull=app.lmcache_server.endpoints["pull"],
                         lmcache_reply=app.lmcache_server.endpoints["reply"])
        proc = spawn.Process(target=storm, args=(endpoints, args.frames, args.huge_share, args.seed, child))
        proc.start()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, parent.recv)  # "bound"
        await asyncio.sleep(0.5)  # warm-up: the subscription reaches the peer
        rss0 = rss_mb()
        gc_pauses(lag)
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
        lag_task.cancel()
        rss1 = rss_mb()
        got = received(app)  # before the valid route below adds one
        gc.collect()
        trimmed = rss1 - rss_mb() if _malloc_trim() else 0.0
        state = {"index": {**app.index.sizes()}, "in_flight": len(app.load),
                 "lmcache_workers": len(app.lmcache_server.workers())}
        unanswered = result["unanswered"]
        try:
            async with AsyncRouteClient(app.service.endpoint or "", timeout_s=5.0) as client:
                d = await client.route("after-storm", token_ids=list(range(64)), turn=0)
                valid_after = d.instance_id is not None
        except Exception:
            valid_after = False
        if not valid_after:
            unanswered += 1
        dead = [t.get_name() for t in app._tasks if t.done()]
        internal = app.core.counters["internal_errors"] + app.lmcache_server.stats["internal_errors"] + sum(
            s.stats.internal_errors for s in app.subscribers.values())
        return {
            "sent": {k: v for k, v in result.items() if k.startswith("sent_")},
            "received": got,
            "elapsed_s": round(elapsed, 1),
            "rss_returned_by_malloc_trim_mb": round(trimmed, 1),
            "loop": {k: round(v * 1000, 1) for k, v in lag.items()},
            "state_after": state,
            "valid_route_after": valid_after,
            "dead_parts": dead,
            "internal_errors": internal,
            "errors_by_code": dict(app.core.errors_by_code),
            "lmcache": {k: app.lmcache_server.stats[k] for k in ("decode_errors", "workers_refused", "oversize_frames")},
            "kv": {k: getattr(app.subscribers["a"].stats, k) for k in ("decode_errors", "bad_frames",
                                                                        "oversize_batches", "unfilled_gaps")},
            "json": {
                "malformed_frames": sum(got.values()),
                "controller_crashes": crashes.crashes + len(dead),
                "unanswered_requests": unanswered,
                "max_loop_stall_ms": round(lag["max"] * 1000, 1),
                "rss_growth_mb": round(rss1 - rss0, 1),
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
    args = p.parse_args()
    out = asyncio.run(run(args))
    report = {k: v for k, v in out.items() if k != "json"}
    for k, v in report.items():
        print(f"{k}: {v}")
    print(json.dumps(out["json"]))


if __name__ == "__main__":
    main()
