"""Keeps a local stack's processes running: a part that exits is restarted, the rest keep serving.

A part that exits is logged with its exit status and log file, its process group is swept (an
engine's core processes may outlive its API server and hold its ports), and a fresh process with
the same command line starts after a backoff: ``backoff_s``, doubling per restart up to
``max_backoff_s``, back to ``backoff_s`` once a run lasted ``healthy_after_s``. A restarted part is
not waited for: the controller's circuit breaker takes a dead engine out of routing within a
poll and brings it back at its first answered probe, and the gateway fails over meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from smetric_lmc.backoff import Backoff
from smetric_lmc.workers import launch

log = logging.getLogger(__name__)


def fresh(proc: launch.ProcessGroup) -> launch.ProcessGroup:
    """A new, unstarted process with ``proc``'s command line, environment and log."""
    if isinstance(proc, launch.EngineProcess):
        return launch.EngineProcess(proc.launch, proc.http_url, proc.log_path, proc.name)
    return launch.ProcessGroup(proc.argv, proc.env, proc.log_path, proc.name, proc.cwd)


@dataclass
class Part:
    proc: launch.ProcessGroup
    on_replace: Callable[[launch.ProcessGroup], None] | None = None  # tell the owner of the new process
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    backoff: Backoff | None = None  # set by the Supervisor
    due: float | None = None  # when an exited part restarts

    @property
    def name(self) -> str:
        return self.proc.name


class Supervisor:
    def __init__(
        self,
        parts: list[Part],
        *,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        healthy_after_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.parts = parts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.clock = clock
        for p in parts:
            p.backoff = Backoff(backoff_s, max(backoff_s, max_backoff_s))

    def check(self) -> list[str]:
        """One pass: notice exits, restart parts whose backoff ran out; returns the restarted."""
        now = self.clock()
        restarted = []
        for part in self.parts:
            if part.due is None:
                rc = part.proc.poll()
                if rc is None:
                    continue
                assert part.backoff is not None
                if now - part.started >= self.healthy_after_s:
                    part.backoff.reset()  # it had been up a while: start over
                delay = part.backoff.next()
                part.due = now + delay
                log.error("%s exited with %s after %.1f s; restarting in %.1f s (log %s)", part.name, rc,
                          now - part.started, delay, part.proc.log_path)
            if now < part.due:
                continue
            part.proc.stop(timeout_s=5.0)  # sweeps what is left of its process group
            new = fresh(part.proc)
            new.start()
            part.proc, part.started, part.due = new, now, None
            part.restarts += 1
            if part.on_replace is not None:
                part.on_replace(new)
            restarted.append(part.name)
        return restarted
