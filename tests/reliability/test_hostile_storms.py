"""Storms of malformed messages on every peer-facing socket of a real controller.

A ``ControllerApp`` runs in-process with its route socket, its LMCache worker sockets and a KV
event subscriber following a stand-in engine (a real XPUB and replay ROUTER on loopback). Each
storm draws its messages from ``bench/kit/hostile.py`` with a fixed seed, then checks that every
request that reached a handler was answered, nothing crashed, and a valid request still works.
The storms are small here (thousands of messages, seconds); ``bench/soak.py`` runs the large ones.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from app_helpers import RecordedEngine
from helpers import wait_for
from kit import hostile

from smetric_lmc.client import AsyncRouteClient
from smetric_lmc.config import parse_config
from smetric_lmc.controller import lmcache_proto as P
from smetric_lmc.controller.app import ControllerApp

BS = 16
END = ((1 << 64) - 1).to_bytes(8, "big")
# Small limits so that "too big" is cheap to build and to refuse.
LIMITS = {
    "max_frame_bytes": 1 << 20,
    "max_prompt_tokens": 100_000,
    "kv_max_frame_bytes": 16 << 20,  # above every storm message: larger ones cut the connection
    "kv_max_events_per_batch": 1000,
    "kv_max_blocks_per_event": 1024,
    "replay_frame_timeout_s": 0.4,
    "replay_deadline_s": 0.5,
    "lmcache_max_frame_bytes": 4 << 20,
    "lmcache_max_workers": 64,
    "lmcache_max_sync_batches": 1000,
}


@pytest.fixture
async def stack() -> AsyncIterator[tuple[ControllerApp, RecordedEngine]]:
    ctx = zmq.asyncio.Context()
    engine = RecordedEngine([], ctx)  # nothing recorded: every replay ends at once
    cfg = {**hostile.target_config("tiny", BS, engine.pub_port, engine.replay_port), "limits": LIMITS}
    app = ControllerApp(parse_config(cfg))
    await app.start()
    msg = await asyncio.wait_for(engine.pub.recv(), 5)  # the subscription: no slow-joiner loss
    assert msg[:1] == b"\x01"
    try:
        yield app, engine
    finally:
        await app.close()
        await engine.close()
        ctx.destroy(linger=0)


def alive(app: ControllerApp) -> None:
    """Every part still running and no handler raised."""
    for task in app.supervisor.tasks:
        assert not task.done(), f"part {task.get_name()} ended"
    assert app.core.counters["internal_errors"] == 0
    if app.lmcache_server is not None:
        assert app.lmcache_server.stats["internal_errors"] == 0
    for sub in app.subscribers.values():
        assert sub.stats.internal_errors == 0 and sub.stats.sink_errors == 0


async def valid_route_works(app: ControllerApp) -> None:
    async with AsyncRouteClient(app.service.endpoint or "", timeout_s=5.0) as client:
        d = await client.route(f"ok-{time.monotonic_ns()}", token_ids=list(range(100, 164)), turn=0)
        assert d.instance_id in ("a", "b")
        await client.done(d.request_id)
        assert (await client.health()).ok


def dealer(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


async def exchange(sock: zmq.asyncio.Socket, messages: list[list[bytes]], window: int = 64) -> int:
    """Send ``messages`` in windows and count the replies; a missing reply times the test out."""
    replies = 0
    for start in range(0, len(messages), window):
        batch = messages[start : start + window]
        for m in batch:
            await sock.send_multipart(m)
        for _ in batch:
            await asyncio.wait_for(sock.recv_multipart(), 10)
            replies += 1
    return replies


async def test_route_storm_every_request_answered(stack: tuple[ControllerApp, RecordedEngine]) -> None:
    app, _ = stack
    rng = random.Random(11)
    messages = [hostile.route_message(rng, k) for k in hostile.storm_kinds(rng, 3000, huge_share=0.003)]
    ctx = zmq.asyncio.Context()
    sock = dealer(ctx, app.service.endpoint or "")
    try:
        assert await exchange(sock, messages) == len(messages)
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)
    alive(app)
    errors = app.core.errors_by_code
    assert errors.get("bad_request", 0) > 1000 and errors.get("too_large", 0) >= 1
    await valid_route_works(app)


async def test_lmcache_storm_leaves_registry_bounded(stack: tuple[ControllerApp, RecordedEngine]) -> None:
    app, _ = stack
    server = app.lmcache_server
    rng = random.Random(12)
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(server.endpoints["pull"])
    sock = dealer(ctx, server.endpoints["reply"])
    try:
        pushes = [hostile.lmcache_push(rng, k) for k in hostile.storm_kinds(rng, 2000, huge_share=0.003)]
        for frame in pushes:
            await push.send(frame)
        requests = [hostile.lmcache_request(rng, k) for k in hostile.storm_kinds(rng, 1000, huge_share=0.003)]
        assert await exchange(sock, requests) == len(requests)
        await wait_for(lambda: server.stats["pull_frames"] >= len(pushes), 20, "every PULL frame handled")
        # A configured worker still registers and its admits reach the index.
        reg = P.RegisterMsg(instance_id="a", worker_id=0, ip="127.0.0.1", port=1, peer_init_url=None)
        await sock.send_multipart([b"", P.encode(reg)])
        reply = P.decode((await asyncio.wait_for(sock.recv_multipart(), 5))[-1])
        before = app.index.stats["lmcache_admitted"]
        ops = [P.KVOpEvent(op_type="admit", key=k, seq_num=k) for k in range(5)]
        await push.send(P.encode(P.BatchedKVOperationMsg(instance_id="a", worker_id=0, location="L", operations=ops)))
        await wait_for(lambda: app.index.stats["lmcache_admitted"] >= before + 5, 5, "admits applied")
    finally:
        push.close(linger=0)
        sock.close(linger=0)
        ctx.destroy(linger=0)
    # The cap may refuse the configured worker when ghosts filled it: it must not have.
    assert isinstance(reply, P.RegisterRetMsg), reply
    workers = server.workers()
    assert sum(w.instance_id is None for w in workers) == LIMITS["lmcache_max_workers"]
    assert [(w.lmcache_instance_id, w.worker_id) for w in workers if w.instance_id is not None] == [("a", 0)]
    assert server.stats["workers_refused"] > 0 and server.stats["decode_errors"] > 500
    alive(app)
    await valid_route_works(app)


async def test_kv_event_storm_then_valid_events_apply(stack: tuple[ControllerApp, RecordedEngine]) -> None:
    app, engine = stack
    sub = app.subscribers["a"]
    rng = random.Random(13)
    kinds = hostile.storm_kinds(rng, 2000, huge_share=0.003)
    for i, kind in enumerate(kinds):
        await engine.pub.send_multipart(hostile.kv_message(rng, kind, b"kv", i))
        if i % 100 == 0:
            await asyncio.sleep(0)  # let the subscriber drain (a PUB drops at its HWM, a gap is fine too)

    def handled() -> int:
        s = sub.stats
        return s.batches + s.decode_errors + s.bad_frames + s.other_topic + s.oversize_batches + s.duplicates

    try:
        await wait_for(lambda: handled() >= len(kinds) * 0.9, 30, "the storm handled")
    except AssertionError:
        raise AssertionError(f"{handled()} of {len(kinds)} handled: {sub.stats}") from None
    await asyncio.sleep(0.6)  # any replay (deadline 0.5 s) ends
    assert sub.stats.decode_errors > 100 and sub.stats.bad_frames > 50 and sub.stats.oversize_batches >= 1
    assert sub.stats.events.get("malformed", 0) > 50
    # The stream goes on: a valid batch right after the last seq is applied and routes stick to it.
    tokens = [rng.randrange(50_000) for _ in range(8 * BS)]
    from smetric_lmc.hashing import fast_chain

    hashes = list(range(1, 9))
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
          "block_size": BS, "medium": "GPU"}
    seq = (sub.stats.last_seq or 0) + 1
    await engine.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time() + 10, [ev], 0])])
    await wait_for(lambda: sub.stats.last_seq == seq, 5, "valid batch applied")
    chain = fast_chain(tokens, BS, root=app.hashing.fast_root)
    assert app.index.gpu_blocks_of("a") >= len(chain)
    async with AsyncRouteClient(app.service.endpoint or "", timeout_s=5.0) as client:
        d = await client.route("sticky", token_ids=tokens, turn=1, est_hit_tokens=len(tokens))
        assert d.instance_id == "a" and d.local_hit_tokens == len(tokens)
    alive(app)


async def test_slow_replay_peer_is_cut_at_the_deadline(stack: tuple[ControllerApp, RecordedEngine]) -> None:
    # A replay peer that trickles one batch just inside the per-batch timeout is cut at the
    # total deadline, and live ingest resumes.
    app, engine = stack
    sub = app.subscribers["a"]
    engine._task.cancel()
    await asyncio.gather(engine._task, return_exceptions=True)

    async def trickle() -> Any:
        ident, empty, _start = await engine.replay.recv_multipart()
        seq = 0
        while True:
            await asyncio.sleep(0.05)
            payload = msgspec.msgpack.encode([time.time(), [], 0])
            await engine.replay.send_multipart([ident, empty, b"kv", seq.to_bytes(8, "big"), payload])
            seq += 1

    slow = asyncio.create_task(trickle())
    try:
        t0 = time.monotonic()
        # seq 50 first: a gap from 0, so the subscriber asks for a replay.
        await engine.pub.send_multipart([b"kv", (50).to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [], 0])])
        await wait_for(lambda: sub.stats.last_seq == 50, 5, "live batch applied after the replay")
        took = time.monotonic() - t0
    finally:
        slow.cancel()
        await asyncio.gather(slow, return_exceptions=True)
    assert sub.stats.replay_deadlines == 1
    assert took < LIMITS["replay_deadline_s"] + 1.5, took
    alive(app)
