"""Fault figures: a dead engine out of and back into routing, and a controller killed and restarted.

    python bench/faults.py                  # both; ends with ONE JSON line
    python bench/faults.py --only engine    # or: --only restart

Dead engine (``dead_engine``): two engine processes (a small aiohttp stand-in serving ``/metrics``,
``/tokenize`` and ``/v1/chat/completions``: no model runs here), an in-process controller polling
them every ``--poll-s`` (``smetric up``'s 1 s by default), and the real gateway in front, with
clients sending chat requests through it. One engine is killed with SIGKILL;
``dead_engine_out_s`` is the time until the controller takes it out of routing (the gateway's
connect error reports it). ``dead_engine_out_idle_s`` is the same with no traffic (the failed
poll alone). The engine is started again on its port; ``engine_back_s`` is the time from its port
answering to its return to routing. ``client_errors`` counts client requests that did not get a 200.

Restart (``controller_restart``): an engine stand-in publishes vLLM-shaped KV-event batches on a
ZMQ PUB (sessions growing turn by turn under their parent block, a shared system prompt, evictions
from session tails) and answers replays from what it published. ``smetric controller`` runs as a process with an index snapshot every 0.5 s; it is
killed with SIGKILL while batches flow, batches keep flowing while it is down, and a new one starts
with the same config. ``restart_first_route_s``: from starting the new process to its first route
decision naming an instance (``restart_first_route_after_start_s``: from the controller's own
start, i.e. without the interpreter's start and imports). Once it has caught up, it is stopped with SIGTERM (it writes its
index to the snapshot file) and ``restart_index_equal`` says whether that index equals one built
by applying every batch the engine published (``tests/index_content.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml
import zmq
import zmq.asyncio
from aiohttp import web
from kit.index_content import same_content

from smetric_lmc.client import RouteClient, RouteError
from smetric_lmc.config import parse_config
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.controller.vllm_plan import apply_batch
from smetric_lmc.controller.vllm_wire import decode_payload
from smetric_lmc.gateway import Gateway
from smetric_lmc.index import TierIndex
from smetric_lmc.index import snapshot as index_snapshot
from smetric_lmc.workers.launch import free_ports

END = ((1 << 64) - 1).to_bytes(8, "big")
METRICS = (
    "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 0.0\n"
    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\"} 0.0\n"
)
# An engine stand-in as its own process, so that SIGKILL kills it the way it kills vLLM.
ENGINE = r'''
import json, sys
from aiohttp import web
METRICS = sys.argv[2]
async def metrics(_r): return web.Response(text=METRICS, content_type="text/plain")
async def tokenize(r):
    b = await r.json(); toks = list(json.dumps(b.get("messages") or b.get("prompt")).encode())
    return web.json_response({"tokens": toks, "count": len(toks), "max_model_len": 1 << 20})
async def chat(r):
    await r.json()
    return web.json_response({"id": "x", "object": "chat.completion", "choices": [{"index": 0,
        "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}})
app = web.Application()
app.router.add_get("/metrics", metrics); app.router.add_post("/tokenize", tokenize)
app.router.add_post("/v1/chat/completions", chat)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
'''




def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


async def _until(cond: Any, timeout_s: float, what: str, poll_s: float = 0.002) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(poll_s)
    return time.monotonic()


def _engine(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", ENGINE, str(port), METRICS], stdin=subprocess.DEVNULL)


# ---- dead engine ----------------------------------------------------------------------------------------


async def dead_engine(poll_s: float = 1.0, clients: int = 4) -> dict[str, Any]:
    """Kill -9 one of two engines under gateway traffic, then idle; start it again. Seconds."""
    eports, (route_port, gw_port) = free_ports(2), free_ports(2)
    procs = {f"e{i}": _engine(p) for i, p in enumerate(eports)}
    raw = {"model": "tiny", "hashing": {"block_size": 16},
           "instances": [{"id": f"e{i}", "http": f"http://127.0.0.1:{p}"} for i, p in enumerate(eports)],
           "server": {"route_url": f"tcp://127.0.0.1:{route_port}"},
           "load": {"metrics_poll_s": poll_s, "metrics_timeout_s": max(0.2, poll_s * 0.8)}}
    cfg = parse_config(raw)
    app = ControllerApp(cfg, enable_metrics_http=False)
    runner: web.AppRunner | None = None
    out: dict[str, Any] = {}
    stop = asyncio.Event()
    results = {"ok": 0, "errors": 0}
    try:
        await _until(lambda: all(_answers(p) for p in eports), 20, "engines")
        await app.start()
        await _until(lambda: sorted(app.membership.routable_ids()) == ["e0", "e1"], 10, "both engines routable")
        gw = Gateway(cfg, route_timeout_s=1.0)
        runner = web.AppRunner(gw.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", gw_port).start()

        async def client(k: int) -> None:
            async with aiohttp.ClientSession() as http:
                n = 0
                while not stop.is_set():
                    n += 1
                    body = {"model": "tiny", "messages": [{"role": "user", "content": f"client {k} request {n}"}]}
                    try:
                        async with http.post(f"http://127.0.0.1:{gw_port}/v1/chat/completions", json=body) as r:
                            await r.read()
                            results["ok" if r.status == 200 else "errors"] += 1
                    except aiohttp.ClientError:
                        results["errors"] += 1
                    await asyncio.sleep(0.01)

        load = [asyncio.create_task(client(k)) for k in range(clients)]
        await asyncio.sleep(1.0)
        t_kill = time.monotonic()
        procs["e1"].send_signal(signal.SIGKILL)
        t_out = await _until(lambda: app.membership.routable_ids() == ["e0"], 30, "e1 out under traffic")
        out["dead_engine_out_s"] = round(t_out - t_kill, 4)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*load)
        out["client_requests"], out["client_errors"] = results["ok"] + results["errors"], results["errors"]

        procs["e1"].wait()
        procs["e1"] = _engine(eports[1])
        t_up = await _until(lambda: _answers(eports[1]), 20, "e1 listening", poll_s=0.005)
        t_back = await _until(lambda: sorted(app.membership.routable_ids()) == ["e0", "e1"], 30, "e1 back")
        out["engine_back_s"] = round(t_back - t_up, 4)

        await asyncio.sleep(poll_s * 1.5)  # let a regular poll go by: idle, the poll alone tells
        t_kill = time.monotonic()
        procs["e1"].send_signal(signal.SIGKILL)
        t_out = await _until(lambda: app.membership.routable_ids() == ["e0"], 30, "e1 out idle")
        out["dead_engine_out_idle_s"] = round(t_out - t_kill, 4)
        out["poll_s"] = poll_s
    finally:
        stop.set()
        if runner is not None:
            await runner.cleanup()
        await app.close()
        for p in procs.values():
            p.kill()
            p.wait()
    return out


# ---- controller restart ----------------------------------------------------------------------------------


def session_payloads(n: int, seed: int = 0, block: int = 16) -> list[bytes]:
    """``n`` vLLM-shaped batches: each stores a turn (2-6 blocks) of a session under its last
    block (a new session under a shared 4-block system prompt), and every 8th removes the tail
    blocks of an old session, as vLLM's free queue gives them up."""
    import random

    rng = random.Random(seed)
    enc = msgspec.msgpack.Encoder()

    def stored(hashes: list[int], parent: int | None) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": [rng.randrange(150_000) for _ in range(block * len(hashes))], "block_size": block,
                "lora_id": None, "medium": "GPU", "lora_name": None}

    system = [rng.getrandbits(63) + 1 for _ in range(4)]
    sessions: list[list[int]] = []
    out = [enc.encode([1.7e9, [stored(system, None)], 0])]
    ts = 1.7e9
    for k in range(1, n):
        ts += 0.01
        new = [rng.getrandbits(63) + 1 for _ in range(rng.randrange(2, 7))]
        if sessions and rng.random() < 0.7:
            s = rng.choice(sessions)
            events = [stored(new, s[-1])]
            s.extend(new)
        else:
            events = [stored(new, system[-1])]
            sessions.append(new)
        if k % 8 == 0 and len(sessions) > 4:
            old = sessions[rng.randrange(len(sessions) // 2)]
            cut = max(1, len(old) // 2)
            events.append({"type": "BlockRemoved", "block_hashes": old[-cut:][::-1], "medium": "GPU"})
            del old[-cut:]
            if not old:
                sessions.remove(old)
        out.append(enc.encode([ts, events, 0]))
    return out


# ---- controller restart (its parts) ---------------------------------------------------------------------------------


class Engine:
    """Publishes vLLM-shaped batches on a PUB (bound, as vLLM binds it) and answers
    replays from everything published; ``truth`` applies the same batches to an index."""

    def __init__(self, sub_port: int, replay_port: int, metrics_port: int, payloads: list[bytes]) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{sub_port}")  # as vLLM does; the controller connects
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.metrics_port = metrics_port
        self.payloads = payloads
        self.published = -1
        self.replays: list[int] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def metrics(_r: web.Request) -> web.Response:
            return web.Response(text=METRICS, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.metrics_port).start()
        self._tasks.append(asyncio.create_task(self._serve_replay()))

    async def publish_for(self, seconds: float, period_s: float = 0.005) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and self.published + 1 < len(self.payloads):
            seq = self.published + 1
            self.published = seq
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), self.payloads[seq]])
            await asyncio.sleep(period_s)

    async def _serve_replay(self) -> None:
        while True:
            ident, empty, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays.append(first)
            for seq in range(first, self.published + 1):
                await self.router.send_multipart([ident, empty, b"kv", seq.to_bytes(8, "big"), self.payloads[seq]])
            await self.router.send_multipart([ident, empty, b"", END, b""])

    def truth(self) -> TierIndex:
        idx = TierIndex(16)
        idx.register_instance("e0")
        for payload in self.payloads[: self.published + 1]:
            apply_batch(decode_payload(payload), idx, "e0")
        return idx

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        self.ctx.destroy(linger=0)


def _controller(config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as logf:
        return subprocess.Popen([sys.executable, "-m", "smetric_lmc.cli", "controller", "--config", str(config)],
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)


def _first_route(url: str, timeout_s: float) -> float:
    """Blocks until a route names an instance; returns when (monotonic)."""
    deadline = time.monotonic() + timeout_s
    with RouteClient(url, timeout_s=0.05) as c:
        k = 0
        while time.monotonic() < deadline:
            k += 1
            try:
                d = c.route(f"first-{k}", token_ids=[1] * 32, turn=0)
            except RouteError:
                continue
            if d.instance_id is not None:
                c.done(f"first-{k}")
                return time.monotonic()
            time.sleep(0.005)
    raise RuntimeError("no route decision from the restarted controller")


def _stats(url: str) -> dict[str, Any]:
    with RouteClient(url, timeout_s=2.0) as c:
        return c.stats()


async def controller_restart(workdir: Path, batches: int = 1200) -> dict[str, Any]:
    """Kill -9 the controller while batches flow; restart; compare its index with the engine's."""
    sub_port, replay_port, metrics_port, route_port, prom_port = free_ports(5)
    payloads = session_payloads(batches)
    snap = workdir / "index.snap"
    config = workdir / "controller.yaml"
    url = f"tcp://127.0.0.1:{route_port}"
    config.write_text(yaml.safe_dump({
        "model": "tiny", "hashing": {"block_size": 16},
        "instances": [{"id": "e0", "http": f"http://127.0.0.1:{metrics_port}",
                       "kv_events": f"tcp://127.0.0.1:{sub_port}", "replay": f"tcp://127.0.0.1:{replay_port}"}],
        "server": {"route_url": url, "metrics_port": prom_port},
        "load": {"metrics_poll_s": 0.5},
        "snapshot": {"path": str(snap), "interval_s": 0.5},
    }))
    engine = Engine(sub_port, replay_port, metrics_port, payloads)
    await engine.start()
    log_path = workdir / "controller.log"
    first = _controller(config, log_path)
    second: subprocess.Popen[bytes] | None = None
    out: dict[str, Any] = {}
    try:
        await asyncio.to_thread(_first_route, url, 30.0)
        await engine.publish_for(2.0)  # snapshots are written meanwhile
        await _until(lambda: snap.exists(), 10, "a snapshot")
        first.send_signal(signal.SIGKILL)
        first.wait()
        at_kill = engine.published
        await engine.publish_for(0.5)  # lost to the dead controller: only replay brings them
        t_start = time.monotonic()
        second = _controller(config, log_path)
        t_route = await asyncio.to_thread(_first_route, url, 30.0)
        out["restart_first_route_s"] = round(t_route - t_start, 4)
        # The same from the controller's own start (after the interpreter and its imports).
        up = (await asyncio.to_thread(_stats, url))["uptime_s"]
        out["restart_first_route_after_start_s"] = round(t_route - (time.monotonic() - up), 4)
        await engine.publish_for(0.5)
        st = await asyncio.to_thread(_stats, url)
        deadline = time.monotonic() + 30
        while st["snapshot"]["catch_up_s"] is None or st["kv_events"]["e0"]["last_seq"] != engine.published:
            if time.monotonic() > deadline:
                raise RuntimeError(f"restarted controller did not catch up: {st['kv_events']['e0']}")
            await asyncio.sleep(0.05)
            st = await asyncio.to_thread(_stats, url)
        out["restart_catch_up_s"] = st["snapshot"]["catch_up_s"]
        out["restart_restored_blocks"] = st["snapshot"]["restored_blocks"]
        out["restart_replayed_from"] = engine.replays[-1] if engine.replays else None
        out["restart_batches_missed"] = engine.published - at_kill
        second.send_signal(signal.SIGTERM)  # a clean stop writes the index it holds
        second.wait(timeout=30)
        loaded = index_snapshot.read(snap)
        assert loaded is not None
        restarted = TierIndex(16)
        index_snapshot.restore(restarted, loaded)
        diffs = same_content(restarted, engine.truth(), ["e0"])
        out["restart_index_equal"] = not diffs and restarted.gpu_blocks_of("e0") > 0
        out["restart_index_blocks"] = restarted.gpu_blocks_of("e0")
        if diffs:
            out["restart_index_diffs"] = diffs
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        await engine.close()
    return out


async def measure(only: str | None = None, poll_s: float = 1.0, workdir: str | None = None) -> dict[str, Any]:
    """The reliability issue's fault keys (and details), for ``bench/soak.py`` or alone."""
    out: dict[str, Any] = {}
    if only in (None, "engine"):
        out.update(await dead_engine(poll_s))
    if only in (None, "restart"):
        if workdir is not None:
            Path(workdir).mkdir(parents=True, exist_ok=True)
            out.update(await controller_restart(Path(workdir)))
        else:
            with tempfile.TemporaryDirectory(prefix="smetric-faults-") as d:
                out.update(await controller_restart(Path(d)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["engine", "restart"], default=None)
    p.add_argument("--poll-s", type=float, default=1.0, help="the controller's engine /metrics poll period")
    p.add_argument("--workdir", default=None, help="keep the restart run's config, snapshot and log here")
    args = p.parse_args()
    logging.basicConfig(level=os.environ.get("SMETRIC_LOG", "WARNING"))
    out = asyncio.run(measure(args.only, args.poll_s, args.workdir))
    for k, v in out.items():
        print(f"{k:>26}: {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
