"""Route load for ``bench/soak.py``: an open-loop client process at a fixed rate, and a calibration.

The client sends route requests on a schedule (``rate`` per second, not waiting for replies, so a
slow controller shows up as latency rather than as a lower offered rate) over one DEALER with a
correlation frame per request, and records each route's latency from send to reply. With
``done`` it reports every routed request done right after its reply (the done replies are read
and not timed). Prompts are 256 distinct tokens per request, from a rotating window so that some
prompts share prefixes with earlier ones.

Both run at a lower CPU priority (:data:`PEER_NICE`, ``os.nice``): on this bench's two shared
cores the load process otherwise preempts the controller it measures (the soak's worst loop
stalls were run-queue waits while it ran), which a production controller, not sharing cores with
its clients or attackers, does not see. ``bench/soak.py``'s hostile peers do the same.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

_enc = msgspec.msgpack.encode
_dec = msgspec.msgpack.decode


def _route_frame(k: int) -> bytes:
    start = (k * 16) % 100_000
    return _enc({"type": "route", "request_id": f"s{k}", "token_ids": list(range(start, start + 256)), "turn": 0})


#: ``os.nice`` increment of the bench's peer processes (see the module docstring).
PEER_NICE = 10


def lower_priority() -> None:
    """Make this (peer) process yield the CPU to the controller under test (lowering one's own
    priority needs no privilege)."""
    os.nice(PEER_NICE)


def _pct(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def load_client(endpoint: str, rate: float, seconds: float, done: bool, conn: Connection) -> None:
    """Open-loop route load; sends its summary dict through ``conn``."""
    lower_priority()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    sent = answered = errors = 0
    pending: dict[bytes, float] = {}
    lat: list[float] = []
    sent_at: list[float] = []  # parallel to lat: when each answered route was sent
    t0 = time.perf_counter()
    end = t0 + seconds
    steal = steal_reader()
    steal_marks = [(t0, steal())]  # (time, the machine's steal so far) every WINDOW_S

    def read(timeout_ms: int) -> None:
        nonlocal answered, errors
        if not sock.poll(timeout_ms):
            return
        while True:
            try:
                corr, _, payload = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if corr[:1] != b"r":
                continue  # a done's ack
            t_sent = pending.pop(corr, None)
            if t_sent is None:
                continue
            now = time.perf_counter()
            lat.append(now - t_sent)
            sent_at.append(t_sent - t0)
            reply = _dec(payload)
            if reply.get("type") != "decision":
                errors += 1
                continue
            answered += 1
            if done:
                sock.send_multipart([b"d" + corr[1:], b"", _enc({"type": "done", "request_id": reply["request_id"]})])

    while (now := time.perf_counter()) < end:
        due = int((now - t0) * rate)
        while sent < due:
            corr = b"r" + sent.to_bytes(8, "big")
            pending[corr] = time.perf_counter()
            sock.send_multipart([corr, b"", _route_frame(sent)])
            sent += 1
        read(1)
        if now - steal_marks[-1][0] >= WINDOW_S:
            steal_marks.append((now, steal()))
    steal_marks.append((time.perf_counter(), steal()))  # the last, partial window's reading
    drain_until = time.perf_counter() + 5.0
    while pending and time.perf_counter() < drain_until:
        read(50)
    windows = _windows(sent_at, lat, steal_marks, t0)
    # The same routes, only those sent in windows where the hypervisor took under LOW_STEAL_PCT
    # of a CPU: what the server does when the machine gives it its CPUs.
    quiet = {int(w["t_s"] // WINDOW_S) for w in windows if w["steal_pct"] < LOW_STEAL_PCT}
    quiet_lat = sorted(x for t, x in zip(sent_at, lat, strict=True) if int(t // WINDOW_S) in quiet)
    lat.sort()
    conn.send({
        "sent": sent, "answered": answered, "errors": errors, "unanswered": len(pending),
        "routes_per_s": round(answered / seconds, 1),
        "p50_ms": round(1000 * (_pct(lat, 0.5) or 0), 3), "p99_ms": round(1000 * (_pct(lat, 0.99) or 0), 3),
        "p999_ms": round(1000 * (_pct(lat, 0.999) or 0), 3), "max_ms": round(1000 * (lat[-1] if lat else 0), 3),
        "windows": windows,
        "low_steal": {"windows": len(quiet), "routes": len(quiet_lat),
                      "p99_ms": round(1000 * _pct(quiet_lat, 0.99), 3) if quiet_lat else None},
    })
    ctx.destroy(linger=0)


#: Width of the per-window latency figures (``windows`` in the summary).
WINDOW_S = 10.0
#: Windows whose machine steal stays under this (% of one CPU) count as quiet (``low_steal``).
LOW_STEAL_PCT = 5.0


def steal_reader() -> Any:
    """A reader of the CPU time the hypervisor has taken from this machine's CPUs so far (s,
    summed over CPUs; ``/proc/stat``'s steal column, in clock ticks of 10 ms): a thread whose
    virtual CPU is descheduled shows neither CPU time nor run-queue wait. 0.0 where absent."""
    try:
        fd = os.open("/proc/stat", os.O_RDONLY)
    except OSError:
        return lambda: 0.0
    tick = 1 / os.sysconf("SC_CLK_TCK")
    return lambda: int(os.pread(fd, 256, 0).split(maxsplit=9)[8]) * tick


def _windows(sent_at: list[float], lat: list[float], steal_marks: list[tuple[float, float]],
             t0: float) -> list[dict[str, float]]:
    """Per ``WINDOW_S`` of send time: routes, p99 and max latency, and the machine's steal then
    (% of one CPU): a tail made in a few windows of heavy steal is the machine's, not the server's."""
    by_window: dict[int, list[float]] = {}
    for t, x in zip(sent_at, lat, strict=True):
        by_window.setdefault(int(t // WINDOW_S), []).append(x)
    stolen = {int((a - t0) // WINDOW_S): 100 * (sb - sa) / (b - a)
              for (a, sa), (b, sb) in zip(steal_marks, steal_marks[1:], strict=False) if b > a}
    out = []
    for w, xs in sorted(by_window.items()):
        xs.sort()
        out.append({"t_s": w * WINDOW_S, "routes": len(xs), "p99_ms": round(1000 * (_pct(xs, 0.99) or 0), 2),
                    "max_ms": round(1000 * xs[-1], 2), "steal_pct": round(stolen.get(w, float("nan")), 1)})
    return out


def echo_server(conn: Connection) -> None:
    """The machine's floor for :func:`load_client`'s latency: a ROUTER that answers every route
    with a canned decision and every done with an ack, doing no routing work. Run at normal
    priority like the controller; its p99 next to the controller's, at the same rate in the same
    run, tells the controller's share of the soak's tail from the machine's (other processes,
    hypervisor steal). Sends its endpoint, serves until a message arrives on ``conn``."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind("tcp://127.0.0.1:*")
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    decision = _enc({"type": "decision", "request_id": "echo", "instance_id": "a"})
    ack = _enc({"type": "done_ack", "request_id": "echo"})
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not conn.poll(0):
        if not poller.poll(100):
            continue
        while True:
            try:
                ident, corr, empty, payload = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except ValueError:  # another framing: not ours
                continue
            sock.send_multipart([ident, corr, empty, decision if corr[:1] == b"r" else ack])
    ctx.destroy(linger=0)


def calibrate(endpoint: str, seconds: float, window: int, conn: Connection) -> None:
    """Closed-loop route+done with ``window`` routes outstanding: the controller's ceiling here."""
    lower_priority()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    k = answered = 0
    for _ in range(window):
        sock.send_multipart([b"r", b"", _route_frame(k)])
        k += 1
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if not sock.poll(1000):
            continue
        corr, _, payload = sock.recv_multipart()
        if corr != b"r":
            continue
        reply: Any = _dec(payload)
        if reply.get("type") == "decision":
            answered += 1
            sock.send_multipart([b"d", b"", _enc({"type": "done", "request_id": reply["request_id"]})])
        sock.send_multipart([b"r", b"", _route_frame(k)])
        k += 1
    conn.send(answered / seconds)
    ctx.destroy(linger=0)
