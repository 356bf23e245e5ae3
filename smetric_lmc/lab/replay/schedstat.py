"""How much of its core each engine actually got, from the kernel's scheduler statistics.

The calibration replays before and after a validation replay cannot see CPU that another job takes
during it. The kernel can, without looking at the replay's outcome: ``/proc/<pid>/task/<tid>/schedstat``
gives every thread's time on a CPU and time waiting on the run queue (ns). Over an interval, an
engine's *run share* is its worker threads' run time over their run plus run-queue wait: the
fraction of the time the worker wanted its core that it had it. vLLM CPU's worker (a process of
its own, ``VLLM::Worker``) runs the iterations and, between them, spins on its shared-memory queue
with ``sched_yield`` for a second after each read, so while the engine has work the worker is
always runnable and its run share falls when something else holds the pinned core (another job,
or the engine's own API server and engine core). The engine's other threads (API server, engine
core, a dozen gloo and ZMQ threads) mostly sleep and wake briefly, and their wake-up waits count
in a whole-engine share too. Both are recorded (``EngineCpu.since``); the validation scales speed
by the whole engine's share, which did as well as the worker's on a steady machine and halved the
error on a drifting one (docs/validation.md). The simulator's speed for an engine during a
replay is then the calibration's speed scaled by the replay's run share over the calibration's
(``measured_slowdowns``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuTime:
    """Scheduler time of a group of threads (ns) at one instant, and the wall clock (s)."""

    run_ns: int
    wait_ns: int
    wall_s: float

    def __sub__(self, other: CpuTime) -> CpuTime:
        return CpuTime(self.run_ns - other.run_ns, self.wait_ns - other.wait_ns, self.wall_s - other.wall_s)

    @property
    def run_share(self) -> float:
        """Run time over run + run-queue wait (an interval's: subtract two samples first)."""
        total = self.run_ns + self.wait_ns
        if total <= 0:
            raise ValueError("no runnable time in this interval: the threads never wanted a CPU")
        return self.run_ns / total

    @property
    def wait_per_s(self) -> float:
        """Run-queue wait per second of wall time (summed over threads)."""
        return self.wait_ns / 1e9 / self.wall_s if self.wall_s > 0 else float("nan")


def parse_schedstat(text: str) -> tuple[int, int]:
    """``/proc/.../schedstat``: ``<ns on cpu> <ns waiting on a run queue> <timeslices>``."""
    fields = text.split()
    if len(fields) != 3 or not all(f.isdigit() for f in fields):
        raise ValueError(f"not a schedstat line: {text!r}")
    return int(fields[0]), int(fields[1])


def group_pids(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes of process group ``pgid`` (an engine: API server, engine core, workers)."""
    out = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # gone while we looked
    return out


WORKER = "VLLM::Worker"  # the thread that runs the model's iterations (vLLM names its worker processes so)


def sample_group(pgid: int, wall_s: float, proc: Path = Path("/proc"), comm: str | None = None) -> CpuTime:
    """Run and run-queue time summed over the threads of the process group (those whose name starts
    with ``comm``, when given). A thread that ends between two samples takes its time with it; the
    engines' threads live as long as the engine."""
    run = wait = 0
    for pid in group_pids(pgid, proc):
        for task in (proc / str(pid) / "task").glob("*"):
            try:
                if comm is not None and not (task / "comm").read_text().startswith(comm):
                    continue
                r, w = parse_schedstat((task / "schedstat").read_text())
            except (OSError, ValueError):
                continue  # a thread that ended meanwhile
            run, wait = run + r, wait + w
    return CpuTime(run, wait, wall_s)


def sample_engines(pgids: dict[str, int], proc: Path = Path("/proc"), comm: str | None = WORKER) -> dict[str, CpuTime]:
    """Per engine, its worker threads' scheduler time (``comm=None``: every thread of the engine)."""
    import time

    now = time.monotonic()
    return {name: sample_group(pgid, now, proc, comm) for name, pgid in pgids.items()}


def run_shares(start: dict[str, CpuTime], end: dict[str, CpuTime]) -> dict[str, float]:
    return {k: (end[k] - start[k]).run_share for k in start}


@dataclass(frozen=True)
class EngineCpu:
    """What the kernel saw of every engine over an interval: the worker threads' run share (the
    speed signal), and for comparison every thread's, the worker's run-queue wait per wall second and
    its run time per wall second."""

    worker: dict[str, CpuTime]
    every: dict[str, CpuTime]

    @classmethod
    def sample(cls, pgids: dict[str, int], proc: Path = Path("/proc")) -> EngineCpu:
        return cls(sample_engines(pgids, proc), sample_engines(pgids, proc, comm=None))

    def since(self, start: EngineCpu) -> dict[str, dict[str, float]]:
        """Per signal and engine (JSON-ready): ``run_share`` (worker), ``run_share_all`` (every thread),
        ``wait_per_s`` and ``run_per_s`` (worker)."""
        w = {k: self.worker[k] - start.worker[k] for k in self.worker}
        return {"run_share": {k: d.run_share for k, d in w.items()},
                "run_share_all": run_shares(start.every, self.every),
                "wait_per_s": {k: d.wait_per_s for k, d in w.items()},
                "run_per_s": {k: d.run_ns / 1e9 / d.wall_s for k, d in w.items()}}


def measured_slowdowns(cal_slowdown: float, cal_share: dict[str, float], replay_share: dict[str, float]) -> dict[str, float]:
    """Per engine, the slowdown during a replay: the calibration's (fitted on its decode time) times
    the calibration's run share over the replay's. An engine that had its core 60% of the time it
    wanted it, where the calibration had it 90%, ran 1.5x slower than the calibration saw."""
    missing = set(cal_share) ^ set(replay_share)
    if missing:
        raise ValueError(f"run shares of different engines: {sorted(missing)}")
    out = {}
    for k, s in replay_share.items():
        if not (0 < s <= 1 and 0 < cal_share[k] <= 1):
            raise ValueError(f"run share out of (0, 1] for {k}: calibration {cal_share[k]}, replay {s}")
        out[k] = cal_slowdown * cal_share[k] / s
    return out


def available() -> bool:
    return Path(f"/proc/{os.getpid()}/schedstat").exists()
