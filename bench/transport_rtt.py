"""The floor of a gateway-to-controller round trip on this machine: ZMQ against plain TCP.

Two processes, one asyncio loop each (uvloop where installed, as the services run), one small
request at a time with a pause between (as a gateway asks once per client request, not in a
burst): a DEALER/ROUTER echo over ``zmq.asyncio`` (the route API's transport) and the same echo
over a plain asyncio TCP stream. What separates them is libzmq's own I/O threads: a message
crosses two more threads each way, and on a virtual machine each wake-up of a sleeping thread
costs. The route service's own time is not in either (``bench/request_cost.py`` has that).

    python bench/transport_rtt.py
    python bench/transport_rtt.py --n 5000 --gap-ms 1

Prints one line per transport, then ONE JSON line:
``{"zmq_p50_us", "zmq_p99_us", "tcp_p50_us", "tcp_p99_us", "zmq_minus_tcp_p50_us", "n", "gap_ms"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

PAYLOAD = b"x" * 300  # about a route request's size with hashes for a short prompt
WARMUP = 100


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    from smetric_lmc.eventloop import run  # uvloop when installed, as the services

    return run(coro)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _zmq_server(port: int) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    while True:
        await sock.send_multipart(await sock.recv_multipart())


async def _tcp_server(port: int) -> None:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)

    server = await asyncio.start_server(echo, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def _serve(kind: str, port: int) -> None:
    _run(_zmq_server(port) if kind == "zmq" else _tcp_server(port))


async def _timed(n: int, gap_s: float, once: Callable[[], Coroutine[Any, Any, None]]) -> list[float]:
    out: list[float] = []
    for k in range(WARMUP + n):
        if k < WARMUP:  # a server that never answers ends the run here (no deadline on the timed calls)
            try:
                await asyncio.wait_for(once(), 10.0)
            except asyncio.TimeoutError:
                raise RuntimeError("the echo server did not answer within 10 s") from None
            continue
        t = time.perf_counter()
        await once()
        out.append((time.perf_counter() - t) * 1e6)
        await asyncio.sleep(gap_s)
    return out


async def _zmq_client(port: int, n: int, gap_s: float) -> list[float]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")

    async def once() -> None:
        await sock.send_multipart([b"", PAYLOAD])
        await sock.recv_multipart()

    try:
        return await _timed(n, gap_s, once)
    finally:
        sock.close(linger=0)
        ctx.term()


async def _tcp_client(port: int, n: int, gap_s: float) -> list[float]:
    for _ in range(100):  # the server process may still be starting
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            break
        except OSError:
            await asyncio.sleep(0.05)
    else:
        raise RuntimeError("the TCP echo server never listened")

    async def once() -> None:
        w.write(PAYLOAD)
        got = 0
        while got < len(PAYLOAD):
            got += len(await r.read(65536))

    try:
        return await _timed(n, gap_s, once)
    finally:
        w.close()


def measure(kind: str, n: int, gap_s: float) -> list[float]:
    port = _free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port)])
    try:
        time.sleep(0.5)
        return sorted(_run(_zmq_client(port, n, gap_s) if kind == "zmq" else _tcp_client(port, n, gap_s)))
    finally:
        server.terminate()
        server.wait(5)


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:  # the echo server's own process (measure starts it)
        _serve(argv[1], int(argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="timed round trips per transport")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="pause between round trips")
    args = ap.parse_args(argv)
    if args.n < 1 or args.gap_ms < 0:
        print("transport_rtt: --n takes a count >= 1 and --gap-ms a pause >= 0", file=sys.stderr)
        return 2
    out: dict[str, Any] = {}
    for k, kind in enumerate(("zmq", "tcp"), 1):
        try:
            xs = measure(kind, args.n, args.gap_ms / 1e3)
        except RuntimeError as exc:
            print(f"transport_rtt: {kind}: {exc}", file=sys.stderr)
            return 1
        out[f"{kind}_p50_us"], out[f"{kind}_p99_us"] = round(_pct(xs, 50), 1), round(_pct(xs, 99), 1)
        print(f"[{k}/2] {kind}: round trip p50 {out[f'{kind}_p50_us']:.0f} µs, p99 {out[f'{kind}_p99_us']:.0f} µs "
              f"over {len(xs)}", flush=True)
    out["zmq_minus_tcp_p50_us"] = round(out["zmq_p50_us"] - out["tcp_p50_us"], 1)
    print(json.dumps({**out, "n": args.n, "gap_ms": args.gap_ms}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
