"""Dead engines out fast, back fast: the controller's circuit breaker on real sockets.

Engines are small aiohttp servers standing in for vLLM's ``/metrics`` (no model runs here); the
controller, its poller and its route socket are the real ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from app_helpers import FakeEngine, base_config  # noqa: E402
from helpers import wait_for
from services import free_port

from smetric_lmc.client import AsyncRouteClient
from smetric_lmc.config import parse_config
from smetric_lmc.controller.app import ControllerApp


class Pair:
    """Two fake engines a and b and a controller that polls them."""

    def __init__(self) -> None:
        self.ports = {"a": free_port(), "b": free_port()}
        self.engines = {k: FakeEngine(p) for k, p in self.ports.items()}
        self.app: ControllerApp | None = None

    async def start_app(self, **load: Any) -> ControllerApp:
        cfg = base_config(
            instances=[{"id": k, "http": f"http://127.0.0.1:{p}"} for k, p in self.ports.items()],
            load={"instance_timeout_s": 30.0, **load},
        )
        self.app = ControllerApp(parse_config(cfg), enable_metrics_http=False)
        await self.app.start()
        return self.app

    async def close(self) -> None:
        if self.app is not None:
            await self.app.close()
        for e in self.engines.values():
            await e.stop()


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = Pair()
    yield p
    await p.close()


async def _routes(app: ControllerApp, n: int) -> set[str | None]:
    async with AsyncRouteClient(app.service.endpoint or "", timeout_s=3.0) as client:
        seen = set()
        for k in range(n):
            rid = f"q{k}-{time.monotonic_ns()}"
            seen.add((await client.route(rid, token_ids=[k] * 40, turn=0)).instance_id)
            await client.done(rid)
        return seen


async def test_an_engine_that_never_answered_gets_no_first_turns(pair: Pair) -> None:
    await pair.engines["a"].start()  # b never starts
    app = await pair.start_app(metrics_poll_s=0.2)
    await wait_for(lambda: app.membership.routable_ids() == ["a"], 3.0, "a alive")
    assert await _routes(app, 12) == {"a"}
    assert app.membership.breaker("b") == "metrics_poll_failed"


async def test_a_failed_poll_takes_the_engine_out_at_once_and_a_probe_brings_it_back(pair: Pair) -> None:
    for e in pair.engines.values():
        await e.start()
    app = await pair.start_app(metrics_poll_s=0.5, breaker_probe_s=0.1)
    await wait_for(lambda: sorted(app.membership.routable_ids()) == ["a", "b"], 3.0, "both alive")
    app.index.gpu_stored("b", list(range(4)), None, list(range(2000, 2000 + 32 * 4)), 32)
    t0 = time.monotonic()
    await pair.engines["b"].stop()
    # Out at the next poll (<= one interval), not after instance_timeout_s (30 s here).
    await wait_for(lambda: app.membership.routable_ids() == ["a"], 1.5, "b out")
    out_s = time.monotonic() - t0
    assert out_s <= 1.0, out_s
    assert app.index.gpu_blocks_of("b") == 4 and app.index.stale_instances() == ["b"]
    assert await _routes(app, 8) == {"a"}
    # Back: the half-open probe runs every 0.1-0.4 s while b is out, not once per interval.
    await pair.engines["b"].start()
    t1 = time.monotonic()
    await wait_for(lambda: sorted(app.membership.routable_ids()) == ["a", "b"], 2.0, "b back")
    assert time.monotonic() - t1 <= 1.0
    assert await _routes(app, 8) == {"a", "b"}


async def test_a_connect_error_from_the_gateway_takes_the_engine_out_before_any_poll(pair: Pair) -> None:
    for e in pair.engines.values():
        await e.start()
    app = await pair.start_app(metrics_poll_s=30.0, breaker_probe_s=0.1)
    await wait_for(lambda: sorted(app.membership.routable_ids()) == ["a", "b"], 3.0, "both alive")
    await pair.engines["b"].stop()
    async with AsyncRouteClient(app.service.endpoint or "", timeout_s=3.0) as client:
        d = await client.route("x1", token_ids=[1] * 40, turn=0)
        other = "a" if d.instance_id == "b" else "b"
        await client.done("x1", instance_id="b", ok=False, error="connect")
        assert app.membership.routable_ids() == ["a"]  # at once: the next poll is 30 s away
        stats = await client.stats()
        assert stats["liveness"]["b"]["breaker_open"] == "gateway_connect_failed"
    assert other in ("a", "b")
    assert await _routes(app, 6) == {"a"}
    await pair.engines["b"].start()
    await wait_for(lambda: sorted(app.membership.routable_ids()) == ["a", "b"], 2.0, "b back via probe")


async def test_without_a_poller_a_reported_engine_is_half_open_after_the_cool_down(pair: Pair) -> None:
    app = await pair.start_app(metrics_poll_s=0, breaker_probe_s=0.2)
    assert sorted(app.membership.routable_ids()) == ["a", "b"]  # no idle-time source of life: routable from start
    app.membership.engine_unreachable("b", "connect")
    assert app.membership.routable_ids() == ["a"]
    await wait_for(lambda: sorted(app.membership.routable_ids()) == ["a", "b"], 2.0, "b half-open")
    app.membership.engine_unreachable("b", "connect")  # fails again: the cool-down doubles
    assert app.membership.routable_ids() == ["a"]
    await asyncio.sleep(0.25)
    assert app.membership.routable_ids() == ["a"]
    await wait_for(lambda: sorted(app.membership.routable_ids()) == ["a", "b"], 2.0, "b half-open again")
    app.membership.engine_unreachable("b", "cut")  # a cut stream is not a dead engine
    assert sorted(app.membership.routable_ids()) == ["a", "b"]
