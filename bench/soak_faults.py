"""Fault phases of ``bench/soak.py``: kill -9 of an engine and of the controller under load, CURVE.

Engines are stand-ins, not vLLM: ``FakeEngine`` (tests/test_controller_app.py, an aiohttp
``/metrics`` endpoint) in a child process that is SIGKILLed, and ``RecordedEngine`` (same file:
real vLLM 0.32 KV-event frames from the shared fixture on a real XPUB, with replay) for the
controller restart.

- ``dead_engine``: two engines, a controller polling their /metrics every ``poll_s``, a client
  routing continuously. ``out_s``: from the kill until the controller stops routing to it (the
  later of: it leaves ``routable()``; the last route it was given). ``back_s``: from the
  restarted engine answering /metrics until it is routable again.
- ``restart``: a controller in a child process follows the engine's events and snapshots its
  index every ``snapshot_s``; under route load it is SIGKILLed, the engine publishes the rest
  of its batches, and a new controller starts from the snapshot. ``first_route_s``: from the
  new controller's construction to its first answered route. ``index_equal``: once caught up,
  its index holds exactly what applying every batch gives (``snapshot.same_content``).
- ``curve``: a route socket with a CURVE allow-list refuses a client with a self-made keypair.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

TESTS = Path(__file__).resolve().parents[1] / "tests"


def _tests_on_path() -> None:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))


def _engine_main(port: int, conn: Connection) -> None:
    _tests_on_path()
    from test_controller_app import FakeEngine

    async def serve() -> None:
        await FakeEngine(port).start()
        conn.send("up")
        await asyncio.Event().wait()

    asyncio.run(serve())


def _start_engine(port: int) -> tuple[mp.process.BaseProcess, float]:
    """A fake engine in a child process; returns it and when it started answering."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_engine_main, args=(port, child), daemon=True)
    p.start()
    if not parent.poll(30) or parent.recv() != "up":
        raise RuntimeError("fake engine did not start")
    return p, time.monotonic()


async def _wait(cond: Any, timeout_s: float, poll_s: float = 0.005) -> float | None:
    """Seconds until ``cond()`` holds, or None after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        await asyncio.sleep(poll_s)
    return None


async def _route_forever(endpoint: str, log: list[tuple[float, str | None]], stop: asyncio.Event) -> None:
    from smetric_lmc.client import AsyncRouteClient, RouteError

    async with AsyncRouteClient(endpoint, timeout_s=2.0) as client:
        k = 0
        while not stop.is_set():
            rid = f"f{k}-{time.monotonic_ns()}"
            k += 1
            try:
                d = await client.route(rid, token_ids=list(range(k % 1000, k % 1000 + 64)), turn=0)
                log.append((time.monotonic(), d.instance_id))
                await client.done(rid)
            except (RouteError, OSError):
                log.append((time.monotonic(), None))
            await asyncio.sleep(0.002)


async def dead_engine(poll_s: float = 0.5, probe_s: float = 0.1) -> dict[str, Any]:
    from replicas import free_ports  # type: ignore[import-not-found]

    from smetric_lmc.config import parse_config
    from smetric_lmc.controller.app import ControllerApp

    ports = dict(zip("ab", free_ports(2), strict=True))
    procs = {k: _start_engine(p)[0] for k, p in ports.items()}
    cfg = {
        "model": "tiny", "hashing": {"block_size": 16},
        "instances": [{"id": k, "http": f"http://127.0.0.1:{p}"} for k, p in ports.items()],
        "server": {"route_url": "tcp://127.0.0.1:*", "metrics_port": 0},
        "load": {"metrics_poll_s": poll_s, "breaker_probe_s": probe_s, "instance_timeout_s": 30.0,
                 "metrics_timeout_s": 1.0},
    }
    app = ControllerApp(parse_config(cfg), enable_metrics_http=False)
    await app.start()
    routes: list[tuple[float, str | None]] = []
    stop = asyncio.Event()
    out: dict[str, Any] = {"poll_s": poll_s, "probe_s": probe_s}
    try:
        if await _wait(lambda: sorted(app.routable()) == ["a", "b"], 10) is None:
            raise RuntimeError("engines never became routable")
        load = asyncio.create_task(_route_forever(app.service.endpoint or "", routes, stop))
        await asyncio.sleep(1.0)
        t_kill = time.monotonic()
        os.kill(procs["b"].pid or 0, signal.SIGKILL)
        left = await _wait(lambda: "b" not in app.routable(), 10)
        await asyncio.sleep(1.0)
        last_b = max((t for t, i in routes if i == "b"), default=t_kill)
        out["routes_to_dead_after_kill"] = sum(1 for t, i in routes if i == "b" and t > t_kill)
        out["out_s"] = None if left is None else round(max(left, last_b - t_kill), 3)
        procs["b"], t_up = _start_engine(ports["b"])
        back = await _wait(lambda: "b" in app.routable(), 10)
        out["back_s"] = None if back is None else round(back, 3)  # _wait starts once the engine answers
        await asyncio.sleep(0.5)
        out["routes_to_b_after_back"] = sum(1 for t, i in routes if i == "b" and t > t_up)
        stop.set()
        await load
    finally:
        stop.set()
        await app.close()
        for p in procs.values():
            p.kill()
            p.join(5)
    return out


def _controller_main(cfg: dict[str, Any], conn: Connection) -> None:
    from smetric_lmc.config import parse_config
    from smetric_lmc.controller.app import ControllerApp

    async def serve() -> None:
        app = ControllerApp(parse_config(cfg), enable_metrics_http=False)
        await app.start()
        conn.send(app.service.endpoint)
        await asyncio.Event().wait()

    asyncio.run(serve())


async def restart(snapshot_s: float = 0.2) -> dict[str, Any]:
    _tests_on_path()
    from replicas import free_ports  # type: ignore[import-not-found]
    from services import fixture_path  # type: ignore[import-not-found]
    from test_controller_app import RecordedEngine

    from smetric_lmc.client import AsyncRouteClient
    from smetric_lmc.config import parse_config
    from smetric_lmc.controller.app import ControllerApp
    from smetric_lmc.controller.vllm_events import apply_batch, decode_payload
    from smetric_lmc.index import TierIndex
    from smetric_lmc.index import snapshot as S

    frames = json.loads(fixture_path("vllm_kv_events.json").read_text())["frames"]
    zctx = zmq.asyncio.Context()
    engine = RecordedEngine(frames, zctx)
    last = len(engine.frames) - 1
    half = last // 2
    tmp = tempfile.mkdtemp(prefix="soak-restart-")
    path = Path(tmp) / "index.snap"
    cfg = {
        "model": "tiny", "hashing": {"block_size": 32},
        "instances": [{"id": "a", "http": "http://127.0.0.1:9", "kv_events": f"tcp://127.0.0.1:{engine.pub_port}",
                       "replay": f"tcp://127.0.0.1:{engine.replay_port}"}],
        "server": {"route_url": f"tcp://127.0.0.1:{free_ports(1)[0]}", "metrics_port": 0},
        "load": {"metrics_poll_s": 0, "instance_timeout_s": 0},
        "snapshot": {"path": str(path), "interval_s": snapshot_s},
    }
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    # Daemonic, so nothing outlives the kill: its route service then has no frame worker (logged).
    proc = spawn.Process(target=_controller_main, args=(cfg, child), daemon=True)
    proc.start()
    out: dict[str, Any] = {"batches": last + 1, "killed_after_batch": half}
    stop = asyncio.Event()
    routes: list[tuple[float, str | None]] = []
    second: ControllerApp | None = None
    try:
        endpoint = await asyncio.get_running_loop().run_in_executor(None, parent.recv)
        await engine.wait_subscribed()
        for seq in range(half + 1):
            await engine.publish(seq)
        load = asyncio.create_task(_route_forever(endpoint, routes, stop))

        def snapped() -> bool:
            snap = S.read(path)
            return snap is not None and snap.instances["a"].seq == half

        if await _wait(snapped, 10, 0.05) is None:
            raise RuntimeError("no snapshot of the first half")
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(5)
        stop.set()
        await load
        for seq in range(half + 1, last + 1):  # the engine goes on while no controller listens
            await engine.publish(seq)
        t0 = time.monotonic()
        second = ControllerApp(parse_config(cfg), enable_metrics_http=False)
        await second.start()
        async with AsyncRouteClient(second.service.endpoint or "", timeout_s=2.0) as client:
            await client.route("after-restart", token_ids=[1] * 64, turn=0)
        out["first_route_s"] = round(time.monotonic() - t0, 3)
        sub = second.subscribers["a"]
        caught = await _wait(lambda: sub.caught_up.is_set() and not second.core.catching_up, 15, 0.01)
        out["caught_up_s"] = None if caught is None else round(time.monotonic() - t0, 3)
        truth = TierIndex(32)
        truth.register_instance("a")
        for _topic, _seq, payload in engine.frames:
            apply_batch(decode_payload(payload), truth, "a")
        diff = S.same_content(second.index, truth, ["a"])
        out["index_equal"] = diff == []
        out["index_diff"] = diff[:5]
        out["replay_requests"] = engine.replay_requests
    finally:
        stop.set()
        if second is not None:
            await second.close()
        if proc.is_alive():
            proc.kill()
        await engine.close()
        zctx.destroy(linger=0)
    return out


def curve_refuses_unknown_client() -> bool:
    from smetric_lmc.client import RouteClient, RouteRefused
    from smetric_lmc.controller.service import RouteCore, RouteService

    _tests_on_path()
    from test_controller_service import make_core

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
