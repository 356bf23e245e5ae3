"""Small asyncio helpers shared by the controller's long-running components."""

from __future__ import annotations

import asyncio
import contextlib


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
