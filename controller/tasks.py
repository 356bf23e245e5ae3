"""Small asyncio helpers shared by the controller's long-running components."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from smetric_lmc.backoff import Backoff

log = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` and wait until it has finished.

    A component's ``close()`` may be awaited from inside its own ``run()`` task (e.g. a
    callback that shuts down on error); cancelling and awaiting that task from itself would
    raise instead of finishing, so the current task is left alone.
    """
    if task is None or task is asyncio.current_task() or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class Supervisor:
    """Runs the controller's long-lived parts as tasks and restarts one that crashes: the
    controller must outlive any one peer's damage. The restart delay doubles per crash and starts
    over once a part ran ``recovered_after_s`` before crashing (it had recovered)."""

    recovered_after_s = 30.0

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop
        self.tasks: list[asyncio.Task[None]] = []

    def spawn(self, name: str, run: Callable[[], Awaitable[Any]]) -> None:
        self.tasks.append(asyncio.create_task(self.supervise(name, run), name=name))

    async def supervise(self, name: str, run: Callable[[], Awaitable[Any]]) -> None:
        backoff = Backoff(0.5, 10.0)
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                if time.monotonic() - started > self.recovered_after_s:
                    backoff.reset()
                delay = backoff.next()
                log.exception("controller: part crashed part=%s restart_in_s=%.1f", name, delay)
                await asyncio.sleep(delay)

    async def cancel_all(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()


@dataclass(frozen=True, slots=True)
class LoopBudget:
    """How much work a socket loop does between two yields to the event loop: ``items``
    messages, ``nbytes`` of them, or ``seconds`` of time, whichever comes first. A count alone
    let a run of multi-MB messages hold the loop (and every other socket) for a long time."""

    items: int = 64
    nbytes: int = 1 << 20
    seconds: float = 0.002

    def meter(self) -> BudgetMeter:
        return BudgetMeter(self)


class BudgetMeter:
    """One loop's spending against a ``LoopBudget``."""

    __slots__ = ("budget", "items", "nbytes", "until")

    def __init__(self, budget: LoopBudget) -> None:
        self.budget = budget
        self.reset()

    def reset(self) -> None:
        self.items, self.nbytes = 0, 0
        self.until = time.perf_counter() + self.budget.seconds

    def spend(self, nbytes: int = 0) -> bool:
        """Count one message of ``nbytes``; True when the budget is spent (yield, then ``reset``)."""
        self.items += 1
        self.nbytes += nbytes
        b = self.budget
        return self.items >= b.items or self.nbytes >= b.nbytes or time.perf_counter() >= self.until
