"""The services' event loop: uvloop when installed, asyncio's own otherwise."""

from __future__ import annotations

import asyncio
import sys

import pytest

from smetric_lmc import eventloop


async def _loop_type() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_runs_on_uvloop_when_installed() -> None:
    pytest.importorskip("uvloop")
    assert eventloop.run(_loop_type()).startswith("uvloop")


def test_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert eventloop.run(_loop_type()).startswith("asyncio")
    loop = eventloop.new_event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()

