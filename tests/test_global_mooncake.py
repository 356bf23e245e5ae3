"""MooncakeGlobalTier: recorded master KV events over a real ZMQ socket, then a real master + store client.

The small aiohttp servers below stand in for the master's admin HTTP only where the
test needs a listing that matches the recorded frames or must inject HTTP 500s;
everything else talks to a real ``mooncake_master`` from the PyPI wheel.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Iterable

import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from helpers import RecorderSink, wait_for
from services import MooncakeMaster, fixture_path, free_port

from smetric_lmc.controller.global_mooncake import MooncakeGlobalTier, open_store_probe
from smetric_lmc.controller.lmcache_keys import ChunkPresence, format_key

MODEL = "tiny/qwen2"


def load_fixture() -> dict:
    return json.loads(fixture_path("mooncake_kv_events.json").read_text())


def fixture_frames(data: dict) -> list[list[bytes]]:
    return [[bytes.fromhex(f) for f in msg] for msg in data["frames"]]


def chunks_of(keys: Iterable[str]) -> set[int]:
    return ChunkPresence(MODEL).reset(keys)


def event_frame(seq: int, events: list[dict]) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([int(time.time() * 1000), events, 0])]


class Publisher:
    """A real ZMQ XPUB (wire-compatible with the master's PUB) that knows when the SUB joined."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    async def wait_subscriber(self) -> None:
        msg = await asyncio.wait_for(self.sock.recv(), 5.0)
        assert msg[:1] == b"\x01"

    async def send(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
async def publisher() -> AsyncIterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


async def start(tier: MooncakeGlobalTier) -> asyncio.Task[None]:
    return asyncio.create_task(tier.run())


# ---- recorded frames --------------------------------------------------------------------------------


async def test_recorded_frames_over_zmq_match_get_all_keys(publisher: Publisher) -> None:
    data = load_fixture()
    expected = chunks_of(data["after_run"]["get_all_keys"]["body"].splitlines())
    sink = RecorderSink()
    tier = MooncakeGlobalTier(sink, model=MODEL, events_endpoint=publisher.endpoint, master_http_url=None)
    task = await start(tier)
    try:
        await publisher.wait_subscriber()
        for frames in fixture_frames(data):
            await publisher.send(frames)
        await wait_for(lambda: tier.stats["messages"] == 26, what="all frames")
        assert sink.chunks == expected == tier.present()
        assert len(expected) == 12
        st = tier.stats
        assert (st["seq_gaps"], st["bad_frames"], st["stored"], st["removed"]) == (0, 0, 19, 7)
        assert tier.available and st["last_seq"] == 26
    finally:
        await tier.close()
    assert task.done() and task.exception() is None


@pytest.fixture
async def listing_server() -> AsyncIterator[dict]:
    """Serves a configurable /get_all_keys body or status (stand-in for error injection)."""
    state: dict = {"body": "", "status": 200, "hits": 0}

    async def get_all_keys(request: web.Request) -> web.Response:
        state["hits"] += 1
        return web.Response(status=state["status"], text=state["body"], content_type="text/plain")

    app = web.Application()
    app.router.add_get("/get_all_keys", get_all_keys)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    state["url"] = f"http://127.0.0.1:{port}"
    yield state
    await runner.cleanup()


async def test_seq_gap_and_garbage_trigger_reconcile(publisher: Publisher, listing_server: dict) -> None:
    data = load_fixture()
    body = data["after_run"]["get_all_keys"]["body"]
    expected = chunks_of(body.splitlines())
    listing_server["body"] = body
    frames = fixture_frames(data)
    # Drop seq 20..22: a stored event whose chunk survives is among them, so only a resync recovers it.
    dropped = [f for f in frames if 20 <= int.from_bytes(f[1], "big") <= 22]
    lost_stored = {ev["object_key"] for m in data["frames_decoded"] if 20 <= m["seq"] <= 22
                   for ev in m["events"] if ev["event_type"] == "stored"}
    assert chunks_of(lost_stored) & expected
    sink = RecorderSink()
    tier = MooncakeGlobalTier(sink, model=MODEL, events_endpoint=publisher.endpoint,
                              master_http_url=listing_server["url"], reconcile_interval_s=60.0)
    task = await start(tier)
    try:
        await publisher.wait_subscriber()
        await wait_for(lambda: tier.stats["reconciles"] == 1, what="initial listing")
        garbage = [
            [b"only-one-frame"], [b"", b"\x00" * 7, b"\x90"], [b"", (1).to_bytes(8, "big"), b"\xc1garbage"],
            [b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode({"not": "a list"})],
        ]
        for g in garbage:
            await publisher.send(g)
        await publisher.send(event_frame(0, [
            "not-a-map", {"event_type": "stored"}, {"event_type": "weird", "object_key": "x"},
            {"event_type": "stored", "object_key": "junk-key"},
        ]))
        hits = listing_server["hits"]
        for f in frames:
            if f not in dropped:
                await publisher.send(f)
        await wait_for(lambda: tier.stats["messages"] == 1 + 26 - 3, what="frames")
        await wait_for(lambda: listing_server["hits"] > hits and tier.stats["reconciles"] >= 2,
                       what="gap reconcile")
        await wait_for(lambda: sink.chunks == expected, what="resynced set")
        st = tier.stats
        assert st["bad_frames"] == 4 and st["bad_events"] == 2 and st["unknown_events"] == 1
        assert st["bad_keys"] == 1
        # seq 0 -> 1 is in order; 1 -> 2 .. 19 in order; 19 -> 23 is the gap.
        assert st["seq_gaps"] == 1 and st["seq_restarts"] == 0
        # A restarted master starts again at seq 1: resync as well.
        await publisher.send(event_frame(1, []))
        await wait_for(lambda: tier.stats["seq_restarts"] == 1 and tier.stats["reconciles"] >= 3,
                       what="restart resync")
    finally:
        await tier.close()
    assert task.done() and task.exception() is None


async def test_http_errors_mark_unavailable_and_recover(listing_server: dict) -> None:
    listing_server["body"] = format_key(MODEL, 1, 0, -9, "bfloat16") + "\n"
    sink = RecorderSink()
    tier = MooncakeGlobalTier(sink, model=MODEL, events_endpoint=None,
                              master_http_url=listing_server["url"], reconcile_interval_s=60.0)
    task = await start(tier)
    try:
        await wait_for(lambda: tier.available and sink.chunks == {-9}, what="listing")
        listing_server["status"] = 500
        tier.request_reconcile()
        await wait_for(lambda: not tier.available, what="500 noticed")
        assert sink.chunks == set() and tier.stats["http_errors"] >= 1
        listing_server["status"] = 200
        await wait_for(lambda: tier.available and sink.chunks == {-9}, timeout_s=8, what="recovery")
    finally:
        await tier.close()
    # Nothing listening at all: counted, never raised.
    tier2 = MooncakeGlobalTier(RecorderSink(), model=MODEL, events_endpoint=None,
                               master_http_url=f"http://127.0.0.1:{free_port()}", reconcile_interval_s=0.1)
    task2 = await start(tier2)
    await wait_for(lambda: tier2.stats["http_errors"] >= 2, what="refused")
    assert not tier2.available and not task2.done()
    await tier2.close()
    assert task.exception() is None and task2.exception() is None


# ---- real mooncake master + store client -------------------------------------------------------------


def mooncake_store_class() -> type:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        pytest.skip(f"mooncake store client not importable: {e} (run .ci/services.sh)")
    return MooncakeDistributedStore


@pytest.mark.services
async def test_real_master_reconcile_yields_live_set(publisher: Publisher) -> None:
    store_cls = mooncake_store_class()
    with MooncakeMaster(lease_ms=300) as master:
        store = store_cls()
        rc = store.setup("127.0.0.1", master.metadata_url, 32 * 1024 * 1024, 8 * 1024 * 1024, "tcp", "",
                         master.master_addr)
        assert rc == 0, f"store setup failed rc={rc}:\n{master.log_tail()}"
        try:
            hashes = [-0x3DB58DD109E8E520, 0x55C46F118F77E136, -5, 0, 2**63 - 1]
            keys = [format_key(MODEL, 1, 0, h, "bfloat16") for h in hashes]
            meta = bytes.fromhex("00001000010000000300000002000000080000000001000080000000")
            for k in keys:
                # LMCache's save_chunk_meta layout: 28-byte RemoteMetadata, then the KV bytes.
                assert store.put_parts(k, meta, b"\x07" * 4096) == 0
            assert store.put(format_key("other/model", 1, 0, 1, "bfloat16"), b"x") == 0
            await asyncio.sleep(0.4)  # let the put lease expire so remove is allowed
            assert store.remove(keys[1]) == 0
            live = set(hashes) - {hashes[1]}

            sink = RecorderSink()
            tier = MooncakeGlobalTier(sink, model=MODEL, events_endpoint=master.events_endpoint,
                                      master_http_url=master.admin_url, reconcile_interval_s=60.0)
            task = await start(tier)
            try:
                await wait_for(lambda: tier.available, what="listing from real master")
                assert sink.chunks == live and tier.stats["last_listing_keys"] == len(live) + 1
                status, text = master.get("/kv_events/status")
                assert status == 200
                # The PyPI wheel's master is built without KV events: the flag is accepted, nothing published.
                assert tier.stats["master_kv_events"] is json.loads(text)["enabled"] is False

                # Probe mode: events told us about all five; a separate zero-memory client's
                # batch_is_exist finds the removed one gone.
                # The tier opens that client itself, off the loop, as the controller configures it
                # (global_store.master_addr + metadata_server), and closes it with itself.
                probe_sink = RecorderSink()
                prober = MooncakeGlobalTier(
                    probe_sink, model=MODEL, events_endpoint=publisher.endpoint, master_http_url=None,
                    open_store=functools.partial(open_store_probe, master.master_addr, master.metadata_url),
                    reconcile_interval_s=60.0)
                probe_task = await start(prober)
                try:
                    await publisher.wait_subscriber()
                    await publisher.send(event_frame(1, [{"event_type": "stored", "object_key": k} for k in keys]))
                    await wait_for(lambda: probe_sink.chunks == set(hashes), what="events")
                    assert await prober.reconcile()
                    assert probe_sink.chunks == live and probe_sink.calls[-1][0] == "reset"
                    assert prober.stats["probe_errors"] == 0
                finally:
                    await prober.close()
                assert probe_task.exception() is None and prober._store is None

                # A client that goes away takes its segment's objects with it, silently.
                await asyncio.to_thread(store.close)
                store = None
                tier.request_reconcile()
                await wait_for(lambda: sink.chunks == set(), what="objects gone with their client")
                assert tier.available
            finally:
                await tier.close()
            assert task.exception() is None
        finally:
            if store is not None:
                await asyncio.to_thread(store.close)
