"""smetric_lmc.client against a real route service on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio
from service_helpers import BS, PROMPT, ROOT, ServiceThread, make_core, seed

from smetric_lmc.client import AsyncRouteClient, RouteClient, RouteError, RouteTimeout, build_route_request
from smetric_lmc.hashing import HashSettings, fast_chain
from smetric_lmc.wire import HashChain


def _free_tcp_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("json", [False, True])
def test_sync_client_round_trip(json: bool) -> None:
    core = make_core()
    seed(core, "i1", PROMPT)
    with ServiceThread(core) as st, RouteClient(st.endpoint, json=json, timeout_s=3.0) as c:
        d = c.route("a1", token_ids=PROMPT, turn=2, est_hit_tokens=600)
        assert (d.instance_id, d.endpoint, d.local_hit_tokens) == ("i1", "http://127.0.0.1:8001", 640)
        assert core.load.in_flight("i1") == 1
        ack = c.done("a1", instance_id="i1", output_tokens=3, ttft_s=0.1)
        assert ack.released and core.load.in_flight("i1") == 0
        assert c.health().routable_instances == 2
        assert c.stats()["service"]["done"] == 1
        assert sorted(i.id for i in c.instances()) == ["i0", "i1"]


def test_client_side_hashing_sends_only_hashes() -> None:
    hs = HashSettings(block_size=BS, fast_root=ROOT, want_chunks=True)
    req = build_route_request("h", token_ids=np.array(PROMPT, dtype=np.int64), hashing=hs)
    assert req.token_ids is None and req.prompt_tokens == len(PROMPT)
    assert req.hashes[0] == HashChain("fast", BS, fast_chain(PROMPT, BS, root=ROOT), root=ROOT)
    assert req.hashes[1].scheme == "lmcache_builtin" and len(req.hashes[1].hashes) == len(PROMPT) // 256
    core = make_core()
    seed(core, "i0", PROMPT)
    with ServiceThread(core) as st, RouteClient(st.endpoint, timeout_s=3.0) as c:
        assert c.hash_settings() == HashSettings(block_size=BS, fast_root=ROOT)
        by_hash = c.route("h1", token_ids=PROMPT, hashing=c.hash_settings(), turn=1, est_hit_tokens=640)
        by_ids = c.route("h2", token_ids=PROMPT, turn=1, est_hit_tokens=640)
        assert (by_hash.instance_id, by_hash.local_hit_tokens, by_hash.prompt_tokens) == ("i0", 640, len(PROMPT))
        assert (by_ids.instance_id, by_ids.local_hit_tokens, by_ids.prompt_tokens) == ("i0", 640, len(PROMPT))


def test_hashes_from_another_root_are_refused_not_routed_as_misses() -> None:
    core = make_core()
    seed(core, "i0", PROMPT)
    other = HashSettings(block_size=BS, fast_root=ROOT ^ 1)
    with ServiceThread(core) as st, RouteClient(st.endpoint, timeout_s=3.0) as c:
        with pytest.raises(RouteError) as err:
            c.route("m1", token_ids=PROMPT, hashing=other, turn=1, est_hit_tokens=640)
        assert err.value.code == "hash_mismatch"
        stats = c.stats()
        assert stats["service"]["hash_mismatch"] == 1 and stats["errors_by_code"]["hash_mismatch"] == 1
        assert c.route("m2", token_ids=PROMPT, hashing=c.hash_settings(), turn=1).local_hit_tokens == 640


def test_error_reply_raises_route_error() -> None:
    with ServiceThread(make_core()) as st, RouteClient(st.endpoint, timeout_s=3.0) as c:
        with pytest.raises(RouteError) as err:
            c.route("e1", hashes=[HashChain("fast", BS * 2, [1, 2])])
        assert err.value.code == "bad_request" and "block_size" in err.value.message
        with pytest.raises(RouteError) as err2:
            c.route("")
        assert err2.value.code == "bad_request"
        assert c.health().ok  # the client keeps working


def test_timeout_raises_and_the_next_call_works() -> None:
    url = _free_tcp_url()
    # A ROUTER that swallows the first request: the client must time out, then recover.
    ctx = zmq.Context()  # its own context: term() waits until the port is released
    black_hole = ctx.socket(zmq.ROUTER)
    black_hole.setsockopt(zmq.LINGER, 0)
    black_hole.bind(url)
    c = RouteClient(url, timeout_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(RouteTimeout) as err:
            c.route("t1", token_ids=[1, 2, 3])
        assert time.monotonic() - t0 >= 0.25  # it did wait for the reply
        assert isinstance(err.value, TimeoutError) and err.value.code == "timeout"
        assert black_hole.poll(1000)
        black_hole.recv_multipart()
    finally:
        black_hole.close(linger=0)
        ctx.term()
    with ServiceThread(make_core(), url=url) as st:
        assert st.endpoint == url
        c.timeout_s = 3.0
        assert c.health().routable_instances == 2
    c.close()


def test_unreachable_controller_times_out_without_queueing() -> None:
    url = _free_tcp_url()
    c = RouteClient(url, timeout_s=0.2)
    with pytest.raises(RouteTimeout):
        c.route("q1", token_ids=[1, 2, 3])
    core = make_core()
    with ServiceThread(core, url=url):
        c.timeout_s = 3.0
        assert c.health().ok
    c.close()
    assert core.counters["route"] == 0  # the timed-out request was never delivered late


async def test_async_client_concurrent_requests() -> None:
    core = make_core()
    seed(core, "i1", PROMPT)
    with ServiceThread(core) as st:
        async with AsyncRouteClient(st.endpoint, timeout_s=3.0, ctx=zmq.asyncio.Context.instance()) as c:
            decisions = await asyncio.gather(
                *(c.route(f"c{k}", token_ids=PROMPT, turn=1, est_hit_tokens=640) for k in range(50))
            )
            assert [d.request_id for d in decisions] == [f"c{k}" for k in range(50)]
            assert sum(d.instance_id == "i1" for d in decisions) >= 1
            acks = await asyncio.gather(*(c.done(f"c{k}") for k in range(50)))
            assert all(a.released for a in acks)
            assert len(core.load) == 0
            h = await c.health()
            assert h.ok
            with pytest.raises(RouteError):
                await c.route("bad", hashes=[HashChain("nope", 16, [])])


async def test_async_client_timeout_then_recovers() -> None:
    url = _free_tcp_url()
    c = AsyncRouteClient(url, timeout_s=0.2)
    with pytest.raises(RouteTimeout):
        await c.health()
    with ServiceThread(make_core(), url=url):
        c.timeout_s = 3.0
        assert (await c.health()).ok
    await c.close()


def test_sync_client_fails_over_to_the_next_replica_and_stays_there() -> None:
    dead = _free_tcp_url()  # nothing listens: the first replica never answers
    core = make_core()
    with ServiceThread(core) as st, RouteClient([dead, st.endpoint], timeout_s=0.3) as c:
        assert c.url == dead and c.retries == 1
        t0 = time.monotonic()
        d = c.route("f1", token_ids=PROMPT, turn=0)
        assert d.instance_id in ("i0", "i1") and 0.25 <= time.monotonic() - t0 < 2.0
        assert c.url == st.endpoint and c.failovers == 1
        assert c.done("f1").released  # on the replica that routed it, without waiting again
        assert c.failovers == 1
    assert core.counters["route"] == 1


def test_client_with_no_replica_answering_raises_after_trying_each() -> None:
    urls = f"{_free_tcp_url()},{_free_tcp_url()}"  # comma-separated: as the CLI takes them
    with RouteClient(urls, timeout_s=0.15) as c:
        assert len(c.urls) == 2
        t0 = time.monotonic()
        with pytest.raises(RouteTimeout):
            c.health()
        assert time.monotonic() - t0 >= 0.28 and c.failovers == 1
    with pytest.raises(ValueError):
        RouteClient(" , ")


async def test_async_client_fails_over_while_other_calls_are_in_flight() -> None:
    url = _free_tcp_url()
    ctx = zmq.Context()
    black_hole = ctx.socket(zmq.ROUTER)  # connected but never answers: a hung replica
    black_hole.setsockopt(zmq.LINGER, 0)
    black_hole.bind(url)
    core = make_core()
    try:
        with ServiceThread(core) as st:
            async with AsyncRouteClient([url, st.endpoint], timeout_s=0.3) as c:
                decisions = await asyncio.gather(*(c.route(f"a{k}", token_ids=PROMPT, turn=0) for k in range(20)))
                assert [d.request_id for d in decisions] == [f"a{k}" for k in range(20)]
                assert c.url == st.endpoint and c.failovers == 1  # moved once, not once per call
                assert all(a.released for a in await asyncio.gather(*(c.done(f"a{k}") for k in range(20))))
    finally:
        black_hole.close(linger=0)
        ctx.term()
    assert core.counters["route"] == 20 and len(core.load) == 0
