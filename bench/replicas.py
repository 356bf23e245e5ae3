"""Routes/s with N controller replicas, and how far apart their in-flight views drift.

    python bench/replicas.py                         # 1, 2 and 4 replicas, 10 s each
    python bench/replicas.py --replicas 1 2 --seconds 5 --no-share

Each replica is a ``ControllerApp`` in its own process (same instances, no engines: every
instance is registered from the config) with load sharing (``replicas.pub_url``/``peers``) on.
Per replica, one client process keeps ``--window`` routes outstanding over a DEALER and reports
each request done ``--hold`` requests later, so ~``hold`` requests per client stay in flight.
A sampler asks every replica for its ``instances`` view every 50 ms and records, per instance,
the largest minus the smallest in-flight count across replicas (``divergence``): with sharing,
that is what one replica's view misses of the others' latest routes; without, each replica
sees only its own share. Samples are taken one replica after another, so the divergence also
holds what changed during the sampling round (a few ms).

Prints a table and ONE JSON line: ``{"replicas": [...], "routes_per_s": [...],
"divergence_max": [...], "divergence_p99": [...], "in_flight_mean": [...]}``. On a machine with
fewer cores than replicas + clients, routes/s cannot grow with replicas: the line says the
CPU count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from smetric_lmc.workers.launch import free_ports

_enc = msgspec.msgpack.encode



def replica_config(idx: int, route_ports: list[int], pub_ports: list[int], share: bool,
                   instances: int) -> dict[str, Any]:
    peers = [f"tcp://127.0.0.1:{p}" for k, p in enumerate(pub_ports) if k != idx] if share else []
    return {
        "model": "bench",
        "hashing": {"block_size": 16},
        "instances": [{"id": f"e{k}", "http": f"http://127.0.0.1:{20000 + k}"} for k in range(instances)],
        "server": {"route_url": f"tcp://127.0.0.1:{route_ports[idx]}", "metrics_port": 0},
        "load": {"metrics_poll_s": 0, "instance_timeout_s": 0},
        "replicas": {"id": f"r{idx}", "pub_url": f"tcp://127.0.0.1:{pub_ports[idx]}" if share else "",
                     "peers": peers},
    }


def _replica(cfg: dict[str, Any], conn: Connection) -> None:
    import logging

    from smetric_lmc.config import parse_config
    from smetric_lmc.controller.app import ControllerApp

    logging.basicConfig(level=logging.WARNING)

    async def serve() -> None:
        app = ControllerApp(parse_config(cfg), enable_metrics_http=False)
        await app.start()
        conn.send("up")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        conn.send({"load": dict(app.load.stats), "share": dict(app.share.stats) if app.share else {}})
        await app.close()

    asyncio.run(serve())


def _client(endpoint: str, seconds: float, window: int, hold: int, tag: str, conn: Connection) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    conn.send("ready")
    conn.recv()  # go
    held: list[str] = []
    sent = answered = 0

    def send_route() -> None:
        nonlocal sent
        rid = f"{tag}-{sent}"
        toks = list(range(sent % 50_000, sent % 50_000 + 64))
        sock.send_multipart([b"", _enc({"type": "route", "request_id": rid, "token_ids": toks, "turn": 0})])
        sent += 1

    for _ in range(window):
        send_route()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if not sock.poll(1000):
            continue
        frames = sock.recv_multipart()
        reply = msgspec.msgpack.decode(frames[-1])
        if reply.get("type") == "decision":
            answered += 1
            held.append(reply["request_id"])
            if len(held) > hold:
                sock.send_multipart([b"", _enc({"type": "done", "request_id": held.pop(0)})])
            send_route()
    conn.send(answered)
    ctx.destroy(linger=0)


def _sample(socks: list[zmq.Socket]) -> list[dict[str, int]] | None:
    views = []
    for s in socks:
        s.send_multipart([b"", _enc({"type": "instances"})])
    for s in socks:
        if not s.poll(2000):
            return None
        msg = msgspec.msgpack.decode(s.recv_multipart()[-1])
        views.append({i["id"]: i["in_flight"] for i in msg["instances"]})
    return views


def run_once(n: int, seconds: float, window: int, hold: int, share: bool, instances: int) -> dict[str, Any]:
    spawn = mp.get_context("spawn")
    ports = free_ports(2 * n)
    route_ports, pub_ports = ports[:n], ports[n:]
    reps, pipes = [], []
    for k in range(n):
        parent, child = spawn.Pipe()
        p = spawn.Process(target=_replica, args=(replica_config(k, route_ports, pub_ports, share, instances), child))
        p.start()
        reps.append(p)
        pipes.append(parent)
    for c in pipes:
        assert c.recv() == "up"
    time.sleep(0.5)  # subscriptions settle before the first route
    clients, cpipes = [], []
    for k in range(n):
        parent, child = spawn.Pipe()
        p = spawn.Process(target=_client, args=(f"tcp://127.0.0.1:{route_ports[k]}", seconds, window, hold,
                                                f"c{k}", child))
        p.start()
        clients.append(p)
        cpipes.append(parent)
    for c in cpipes:
        assert c.recv() == "ready"
    ctx = zmq.Context()
    socks = []
    for port in route_ports:
        s = ctx.socket(zmq.DEALER)
        s.connect(f"tcp://127.0.0.1:{port}")
        socks.append(s)
    for c in cpipes:
        c.send("go")
    divergences: list[int] = []
    in_flight: list[int] = []
    end = time.perf_counter() + seconds
    time.sleep(min(1.0, seconds / 5))  # past the ramp-up
    while time.perf_counter() < end - 0.2:
        views = _sample(socks)
        if views is not None:
            for iid in views[0]:
                vals = [v.get(iid, 0) for v in views]
                divergences.append(max(vals) - min(vals))
            in_flight.append(max(sum(v.values()) for v in views))
        time.sleep(0.05)
    answered = sum(c.recv() for c in cpipes)
    for p in clients:
        p.join(10)
    stats = []
    for c in pipes:
        c.send("stop")
        stats.append(c.recv())
    for p in reps:
        p.join(10)
    ctx.destroy(linger=0)
    divergences.sort()
    return {
        "replicas": n,
        "routes_per_s": round(answered / seconds),
        "divergence_max": divergences[-1] if divergences else None,
        "divergence_p99": divergences[int(0.99 * (len(divergences) - 1))] if divergences else None,
        "in_flight_mean": round(sum(in_flight) / len(in_flight), 1) if in_flight else None,
        "samples": len(in_flight),
        "share_messages_in": [s["share"].get("messages_in", 0) for s in stats],
    }


def measure(replicas: list[int], seconds: float, *, window: int = 32, hold: int = 64, share: bool = True,
            instances: int = 8) -> list[dict[str, Any]]:
    return [run_once(n, seconds, window, hold, share, instances) for n in replicas]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--window", type=int, default=32, help="routes outstanding per client")
    p.add_argument("--hold", type=int, default=64, help="requests each client keeps in flight before done")
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--no-share", action="store_true", help="replicas do not share load (the baseline)")
    args = p.parse_args()
    rows = measure(args.replicas, args.seconds, window=args.window, hold=args.hold, share=not args.no_share,
                   instances=args.instances)
    for r in rows:
        print(r, file=sys.stderr)
    print(json.dumps({
        "cpus": os.cpu_count(),
        "share": not args.no_share,
        **{k: [r[k] for r in rows] for k in ("replicas", "routes_per_s", "divergence_max", "divergence_p99",
                                             "in_flight_mean")},
    }))


if __name__ == "__main__":
    main()
