"""The floor under a router's added latency: what an HTTP stack adds by proxying alone, beside ours.

    python bench/proxy_floor.py                  # 2 rounds x 1,000 triples per configuration (~5 min)
    python bench/proxy_floor.py --rounds 4 --pairs 2000

Issue 24 asks for our added latency p99 <= 2 ms. This bench asks how much of that any Python proxy
on this machine spends before it routes anything. Three proxies that do nothing but forward a
request to one engine and its answer back (no routing, no tokenizing, no metrics):

* ``floor:aiohttp``: aiohttp's server and aiohttp's client, the stack our gateway runs on;
* ``floor:aiohttp+httptools``: aiohttp's server, the engine leg over a keep-alive connection framed
  by hand and parsed by httptools (the C parser uvicorn serves vLLM with);
* ``floor:httptools``: both legs on asyncio protocols with httptools' parsers, no framework;

beside ours (``ours:smetric`` in two processes and in one) and the Rust peers' fastest policy
(``vllm:power_of_two``), in front of the same instant mock engines (``--speed 1000``), probed as
bench/live_peers.py's added-latency phase probes (a triple per step: straight, through, straight
again, the order rotating; the added time is the per-triple difference, the probe's own noise the
two straight requests' difference). The configurations take turns, round after round, so a
drifting machine moves all of them alike; each prints its median over the rounds, with the steal
share over the same seconds.

The two hand-made proxies are measuring instruments for this bench only (one request shape, no
error handling): they say what a leaner HTTP stack would leave, not what to deploy. httptools is
needed for them (``pip install httptools``); without it they are skipped, and the bench says so.

Ends with ONE JSON line: ``{"instances", "rounds", "pairs", "added_p50_ms": {...}, "added_p99_ms":
{...}, "probe_noise_p99_ms": {...}, "steal": x}`` (medians over the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

FLOORS = ("floor:aiohttp", "floor:aiohttp+httptools", "floor:httptools")
ROUTERS = ("ours:smetric", "ours:smetric[process=one]", "vllm:power_of_two")


# ---- the measuring proxies (run as `python bench/proxy_floor.py --serve KIND ...`) --------------
class _EngineLeg:
    """One engine, keep-alive connections, one POST at a time on each, parsed by httptools."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.idle: list[_EngineConn] = []

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        conn = self.idle.pop() if self.idle else (await loop.create_connection(_EngineConn, self.host, self.port))[1]
        answer = conn.send(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), self.port,
                                                              len(body), body))
        status, data = await answer
        self.idle.append(conn)
        return status, data


class _EngineConn(asyncio.Protocol):
    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.answer: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def send(self, request: bytes) -> asyncio.Future[tuple[int, bytes]]:
        self.answer = asyncio.get_running_loop().create_future()
        self.body = []
        self.transport.write(request)
        return self.answer

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.answer is not None:
            self.answer.set_result((self.parser.get_status_code(), b"".join(self.body)))


class _Front(asyncio.Protocol):
    """The client side of ``floor:httptools``: requests parsed by httptools, answered one by one."""

    def __init__(self, leg: _EngineLeg) -> None:
        import httptools

        self.leg = leg
        self.parser = httptools.HttpRequestParser(self)
        self.url = b"/"
        self.body: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        asyncio.ensure_future(self._answer(self.url.decode(), body))

    async def _answer(self, path: str, body: bytes) -> None:
        status, data = await self.leg.post(path, body)
        self.transport.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (status, len(data), data))


def serve(kind: str, upstream: str, port: int) -> None:
    """Run one measuring proxy in front of ``upstream`` until killed."""
    from smetric_lmc import eventloop

    if kind == "floor:httptools":
        async def main() -> None:
            leg = _EngineLeg(upstream)
            server = await asyncio.get_running_loop().create_server(lambda: _Front(leg), "127.0.0.1", port)
            await server.serve_forever()

        eventloop.run(main())
        return
    app = web.Application()
    if kind == "floor:aiohttp":
        async def start(a: web.Application) -> None:
            a["http"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def stop(a: web.Application) -> None:
            await a["http"].close()

        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            async with request.app["http"].post(upstream + request.path, data=body,
                                                headers={"Content-Type": "application/json"}) as up:
                return web.Response(body=await up.read(), status=up.status, content_type="application/json")

        app.on_startup.append(start)
        app.on_cleanup.append(stop)
    else:
        leg = _EngineLeg(upstream)

        async def handle(request: web.Request) -> web.Response:
            status, data = await leg.post(request.path, await request.read())
            return web.Response(body=data, status=status, content_type="application/json")

    app.router.add_post("/v1/completions", handle)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=eventloop.new_event_loop())


# ---- the bench --------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


def _floor_proxy(kind: str, upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    from smetric_lmc.workers import launch

    (port,) = launch.free_ports(1)
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--upstream", upstream, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # until it answers
        try:
            asyncio.run(_one(url))
            return proc, url
        except (aiohttp.ClientError, OSError):
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"proxy_floor: {kind} did not start")


async def _one(url: str) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
        await r.read()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="probes per configuration, taken in turns (default 2)")
    ap.add_argument("--pairs", type=int, default=1000, help="triples per probe (default 1000)")
    ap.add_argument("--instances", type=int, default=8, help="mock engines (default 8)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.upstream, args.port)
        return 0
    if args.rounds < 1 or args.pairs < 10 or args.instances < 1:
        print("proxy_floor: --rounds >= 1, --pairs >= 10 and --instances >= 1", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import live_peers as lp  # the probe, the mock cluster and the routers' launchers

    try:
        import httptools  # noqa: F401
        floors = FLOORS
    except ImportError:
        floors = FLOORS[:1]
        print("proxy_floor: httptools is not installed: only floor:aiohttp runs (pip install httptools)")
    work = Path(tempfile.mkdtemp(prefix="proxy-floor-"))
    started = lp.start_mock_engines(args.instances, work, processes=1, extra_args=["--speed", "1000", *lp.EVENT_ARGS])
    infos = [i for i, _ in started]
    groups = list({id(g): g for _, g in started}.values())
    direct = infos[0].http_url
    procs: list[subprocess.Popen[bytes]] = []
    routers: list[Any] = []
    urls: dict[str, str] = {}
    results: dict[str, list[dict[str, float]]] = {}
    try:
        for kind in floors:
            proc, urls[kind] = _floor_proxy(kind, direct)
            procs.append(proc)
        confs = {c.name: c for c in lp.default_confs()}
        for name in ROUTERS:
            if name.startswith("vllm:") and shutil.which("vllm-router") is None:
                print(f"proxy_floor: vllm-router is not installed: {name} skipped (pip install -e '.[live-peers]')")
                continue
            router = lp.Router(confs[name], infos, work)
            router.start()
            routers.append(router)
            urls[name] = router.url
        total = args.rounds * len(urls)
        done = 0
        for rnd in range(args.rounds):
            for name, url in urls.items():
                asyncio.run(lp._latency(direct, url, 30, 100))  # warm-up: connections, caches
                ours = name.startswith("ours:")
                g0, c0 = lp.gateway_routing(url) if ours else {}, lp._contention()
                s = lp.latency_summary(asyncio.run(lp._latency(direct, url, args.pairs, 100)))
                g1, c1 = lp.gateway_routing(url) if ours else {}, lp._contention()
                s["steal"] = (c1[0] - c0[0]) / max(1.0, c1[1] - c0[1])
                s.update(lp.routing_means(g0, g1))
                results.setdefault(name, []).append(s)
                done += 1
                print(f"[{done}/{total}] round {rnd + 1} {name}: added p50 {s['p50_ms']:.2f} p90 {s['p90_ms']:.2f} "
                      f"p99 {s['p99_ms']:.2f} ms; probe noise p99 {s['noise_p99_ms']:.2f}; straight p50 "
                      f"{s['direct_p50_ms']:.2f}; steal {s['steal']:.1%}{lp._routing_note(s)}", flush=True)
    finally:
        for router in routers:
            router.stop()
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
        for g in groups:
            g.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {name: {k: statistics.median(s[k] for s in runs if k in s) for k in runs[0]} for name, runs in results.items()}
    print(f"\nmedian over {args.rounds} round(s) of {args.pairs} triples, {args.instances} instant mock engines:")
    print("| configuration | added p50 | p90 | p99 (ms) | probe noise p99 | steal | the gateway's routing, mean "
          "(ms) | of which the controller's round trip |")
    print("|---|---|---|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['p50_ms']:.2f} | {m['p90_ms']:.2f} | {m['p99_ms']:.2f} | {m['noise_p99_ms']:.2f} | "
              f"{m['steal']:.1%} | {_ms(m.get('gateway_routing_mean_ms'))} | {_ms(m.get('gateway_route_rtt_mean_ms'))} |")
    steal = statistics.median(s["steal"] for runs in results.values() for s in runs) if results else 0.0
    print(json.dumps({"instances": args.instances, "rounds": args.rounds, "pairs": args.pairs,
                      "added_p50_ms": {n: round(m["p50_ms"], 3) for n, m in med.items()},
                      "added_p99_ms": {n: round(m["p99_ms"], 3) for n, m in med.items()},
                      "probe_noise_p99_ms": {n: round(m["noise_p99_ms"], 3) for n, m in med.items()},
                      "steal": round(steal, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
