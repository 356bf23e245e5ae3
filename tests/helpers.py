"""Test doubles and waits shared by the test modules (import as ``from helpers import ...``)."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType


class RecorderSink:
    """Stands in for the index's global tier: applies the three calls to a set and logs them."""

    def __init__(self) -> None:
        self.chunks: set[int] = set()
        self.calls: list[tuple[str, list[int]]] = []

    def global_stored(self, chunk_hashes: Iterable[int]) -> None:
        hs = list(chunk_hashes)
        self.calls.append(("stored", hs))
        self.chunks.update(hs)

    def global_removed(self, chunk_hashes: Iterable[int]) -> None:
        hs = list(chunk_hashes)
        self.calls.append(("removed", hs))
        self.chunks.difference_update(hs)

    def global_reset(self, chunk_hashes: Iterable[int]) -> None:
        hs = list(chunk_hashes)
        self.calls.append(("reset", hs))
        self.chunks = set(hs)


async def wait_for(
    cond: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition", poll_s: float = 0.02
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(poll_s)


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (polling every 5 ms) until ``cond()`` holds; fail after ``timeout`` seconds."""
    await wait_for(cond, timeout, poll_s=0.005)


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module (the bench folder is not a package)."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
