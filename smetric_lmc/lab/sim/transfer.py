"""KV transfers over shared links: each GPU's host link (PCIe, one resource per direction) and each
node's RDMA NIC (one per direction), shared processor-style by the transfers crossing them.

A *flow* moves bytes over a set of resources; its rate is the smallest equal share it gets on any
of them (capacity / number of flows on that resource). Rates change only when a flow starts or
ends, so the network advances between those instants in closed form. A *job* groups flows (the
same-node and remote parts of one fetch) and calls back once all of them are done.

The network keeps one pending wake-up in the simulator's event heap (``schedule(t, version)``);
an older wake-up is ignored when its version is stale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

DoneFn = Callable[[float], None]
ScheduleFn = Callable[[float, int], None]

_EPS_BYTES = 1e-3  # a flow with less left than this is done (float residue of rate * dt)


class Resource:
    """One direction of one link: capacity in bytes/s, with busy time and bytes carried."""

    __slots__ = ("name", "cap", "n", "busy_s", "bytes", "_since")

    def __init__(self, name: str, cap: float) -> None:
        if not cap > 0:
            raise ValueError(f"{name}: link capacity must be > 0, got {cap}")
        self.name = name
        self.cap = cap
        self.n = 0  # flows crossing it now
        self.busy_s = 0.0  # time with at least one flow: a share of wall time, never above 1
        self.bytes = 0.0
        self._since = 0.0


class _Flow:
    __slots__ = ("left", "res", "rate", "job")

    def __init__(self, nbytes: float, res: tuple[Resource, ...], job: _Job) -> None:
        self.left = nbytes
        self.res = res
        self.rate = 0.0
        self.job = job


class _Job:
    __slots__ = ("pending", "done")

    def __init__(self, done: DoneFn | None) -> None:
        self.pending = 0
        self.done = done


class Network:
    """All links of the cluster; ``start`` a job, get a callback at its completion time."""

    def __init__(self, schedule: ScheduleFn) -> None:
        self._schedule = schedule
        self._flows: list[_Flow] = []
        self._t = 0.0
        self.version = 0
        self.jobs = 0

    def start(self, now: float, parts: Sequence[tuple[float, Sequence[Resource]]], done: DoneFn | None) -> None:
        """Move ``parts`` = [(bytes, resources)] concurrently; ``done(t)`` when all have arrived.
        With nothing to move, ``done`` runs at once."""
        self._advance(now)
        job = _Job(done)
        for nbytes, res in parts:
            if nbytes <= 0:
                continue
            f = _Flow(float(nbytes), tuple(res), job)
            for r in f.res:
                if r.n == 0:
                    r._since = now
                r.n += 1
                r.bytes += nbytes
            job.pending += 1
            self._flows.append(f)
        self.jobs += 1
        if job.pending == 0:
            if done is not None:
                done(now)
            return
        self._reschedule(now)

    def on_wake(self, now: float, version: int) -> None:
        if version != self.version:
            return
        self._advance(now)
        finished: list[_Job] = []
        still: list[_Flow] = []
        for f in self._flows:
            # float residue: the clock's rounding at ~1e5 s times a rate of ~1e10 B/s is bytes
            if f.left <= _EPS_BYTES + f.rate * 1e-9:
                for r in f.res:
                    r.n -= 1
                    if r.n == 0:
                        r.busy_s += now - r._since
                f.job.pending -= 1
                if f.job.pending == 0:
                    finished.append(f.job)
            else:
                still.append(f)
        self._flows = still
        self._reschedule(now)
        for job in finished:
            if job.done is not None:
                job.done(now)

    def close(self, now: float) -> None:
        """Count busy time of links still carrying flows at the end of the run."""
        for f in self._flows:
            for r in f.res:
                if r.n:
                    r.busy_s += now - r._since
                    r._since = now

    @property
    def active(self) -> int:
        return len(self._flows)

    # ---- internals -----------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        dt = now - self._t
        if dt > 0:
            for f in self._flows:
                f.left -= f.rate * dt
        self._t = now

    def _reschedule(self, now: float) -> None:
        nxt = math.inf
        for f in self._flows:
            rate = min(r.cap / r.n for r in f.res)
            f.rate = rate
            t = max(f.left, 0.0) / rate
            if t < nxt:
                nxt = t
        self.version += 1
        if self._flows:
            self._schedule(now + nxt, self.version)
