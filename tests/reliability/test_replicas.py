"""Controller replicas share in-flight load over real PUB/SUB sockets (controller/replicas.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from helpers import wait_for

from smetric_lmc.client import AsyncRouteClient
from smetric_lmc.config import parse_config
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.controller.replicas import LoadShare
from smetric_lmc.load import LoadTracker


def _cfg(rid: str) -> dict[str, object]:
    return {
        "model": "tiny",
        "hashing": {"block_size": 16},
        "instances": [{"id": "a", "http": "http://127.0.0.1:9"}, {"id": "b", "http": "http://127.0.0.1:10"}],
        "server": {"route_url": "tcp://127.0.0.1:*", "metrics_port": 0},
        "load": {"metrics_poll_s": 0, "instance_timeout_s": 0},
        "replicas": {"id": rid, "pub_url": "tcp://127.0.0.1:*"},
    }


@pytest.fixture
async def pair() -> AsyncIterator[tuple[ControllerApp, ControllerApp]]:
    apps = [ControllerApp(parse_config(_cfg(r)), enable_metrics_http=False) for r in ("r1", "r2")]
    for app in apps:
        await app.start()
    a, b = apps
    assert a.share is not None and b.share is not None
    a.share.connect(b.share.endpoint or "")
    b.share.connect(a.share.endpoint or "")
    await asyncio.sleep(0.3)  # the subscriptions reach the publishers (PUB drops before that)
    try:
        yield a, b
    finally:
        for app in apps:
            await app.close()


def loads(app: ControllerApp) -> dict[str, int]:
    return {i: app.load.in_flight(i) for i in ("a", "b")}


async def test_routes_at_one_replica_count_at_the_other(pair: tuple[ControllerApp, ControllerApp]) -> None:
    a, b = pair
    async with AsyncRouteClient(a.service.endpoint or "") as ca, AsyncRouteClient(b.service.endpoint or "") as cb:
        for k in range(6):
            await ca.route(f"q{k}", token_ids=list(range(k, k + 64)), turn=0)
        await wait_for(lambda: loads(b) == loads(a), timeout_s=5)
        assert sum(loads(b).values()) == 6
        # Without sharing b would send its next requests to the instance a already filled:
        # with it, both replicas spread the same way.
        d = await cb.route("q-b", token_ids=list(range(500, 564)), turn=0)
        await wait_for(lambda: sum(loads(a).values()) == 7, timeout_s=5)
        assert a.load.instance_of("q-b") == d.instance_id
        # A done reported to the other replica releases the request at both.
        await cb.done("q0")
        await ca.done("q-b")
        await wait_for(lambda: sum(loads(a).values()) == 5 and sum(loads(b).values()) == 5, timeout_s=5)


def test_a_done_that_overtakes_its_route_cancels_it() -> None:
    load = LoadTracker()
    share = LoadShare(load, "me", "inproc://unused", [])
    enc = msgspec.msgpack.encode
    share.apply(enc(("peer", 1, [["d", "x"]])))
    share.apply(enc(("peer", 2, [["r", "x", "a", 100, 0], ["r", "y", "a", 100, 0]])))
    assert load.in_flight("a") == 1 and load.instance_of("x") is None
    assert share.stats["late_routes_cancelled"] == 1


def test_bad_share_messages_are_counted_not_applied() -> None:
    load = LoadTracker()
    share = LoadShare(load, "me", "inproc://unused", [])
    enc = msgspec.msgpack.encode
    assert share.apply(b"\x91" * 100_000 + b"\xc0") == 0
    assert share.apply(enc(("peer", 1, [["r", 5, "a", 1, 0], ["z", "q"], ["r", "ok", "a", 1, 0]]))) == 1
    assert share.apply(enc(("me", 1, [["r", "own", "a", 1, 0]]))) == 0  # its own message
    assert load.in_flight("a") == 1
    assert share.stats["bad_messages"] == 3
