"""The event loop the services (controller, gateway) run on: uvloop when it is installed, else
asyncio's own. uvloop's transports cut the per-request cost of the gateway's proxying (measured
in docs/peers.md); nothing in the services depends on which loop runs them."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh loop: uvloop's when importable."""
    try:
        import uvloop
    except ImportError:
        log.info("uvloop not installed: running on asyncio's default event loop")
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on :func:`new_event_loop`'s loop (Python 3.10, which has no loop factory:
    asyncio's default loop)."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)
