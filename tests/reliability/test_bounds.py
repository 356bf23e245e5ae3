"""Each bound on peer input, one test each: what a peer may send and what it costs the controller."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import msgspec
import pytest
import zmq
import zmq.asyncio
from helpers import wait_for
from kit import hostile
from service_helpers import PROMPT, make_core  # noqa: E402
from services import free_port

from smetric_lmc.config import ConfigError, LimitsConfig, parse_config
from smetric_lmc.controller import lmcache_proto as P
from smetric_lmc.controller.lmcache_holdings import Holdings, SlotsExhausted
from smetric_lmc.controller.lmcache_server import MISSING_WINDOW, LMCacheWorkerServer
from smetric_lmc.controller.vllm_events import VllmEventSubscriber
from smetric_lmc.controller.vllm_wire import PayloadError, decode_payload
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.wire import ErrorReply, InstancesReply, InstancesRequest, decode_reply, encode

_enc = msgspec.msgpack.encode


def route(**fields: object) -> bytes:
    return _enc({"type": "route", "request_id": "r1", **fields})


# ---- route socket -----------------------------------------------------------------------------


def test_rejected_frame_is_decoded_once() -> None:
    # 200,000 empty arrays: 1 byte each on the wire, a list object each if decoded without a
    # schema. The typed decode refuses it at the first byte; nothing may decode it again.
    core = make_core()
    frame = hostile.huge_array(200_000)
    tracemalloc.start()
    try:
        reply = decode_reply(core.handle(frame))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request"
    assert peak < 1_000_000, peak


@pytest.mark.parametrize("frame", [b"\x81\xa1a" * 100_000 + b"\x01", b"\x91" * 100_000 + b"\xc0",
                                   b'{"a":' * 100_000 + b"1" + b"}" * 100_000], ids=["maps", "arrays", "json"])
def test_deep_nesting_is_a_bad_request(frame: bytes) -> None:
    core = make_core()
    reply = decode_reply(core.handle(frame))
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
    assert core.counters["internal_errors"] == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"token_ids": PROMPT, "prompt_tokens": (1 << 64) - 1},
        {"token_ids": PROMPT, "prompt_tokens": -1},
        {"token_ids": PROMPT, "turn": 10**9},
        {"token_ids": PROMPT, "est_hit_tokens": 1 << 40},
        {"token_ids": [1, 2, 1 << 32]},
        {"token_ids": [1, -5]},
        {"hashes": [{"scheme": "fast", "block_size": 16, "hashes": [3, -1]}]},
        {"hashes": [{"scheme": "fast", "block_size": 0, "hashes": [3]}]},
        {"hashes": [{"scheme": "fast", "block_size": 16, "hashes": [1]}] * 5},
    ],
)
def test_integer_fields_are_bounded(fields: dict[str, object]) -> None:
    core = make_core()
    reply = decode_reply(core.handle(route(**fields)))
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
    assert reply.request_id == "r1"  # found after decoding: the reply names the request
    # Nothing was counted as load: every later reply still encodes.
    assert isinstance(decode_reply(core.handle(encode(InstancesRequest()))), InstancesReply)


def test_token_and_hash_lists_are_bounded() -> None:
    core = make_core()
    core.limits = LimitsConfig(max_prompt_tokens=1000)
    assert decode_reply(core.handle(route(token_ids=[1] * 1001))).code == "too_large"
    too_many = [{"scheme": "fast", "block_size": 16, "hashes": list(range(1000 // 16 + 2))}]
    assert decode_reply(core.handle(route(hashes=too_many))).code == "too_large"
    ok = decode_reply(core.handle(route(token_ids=[1] * 1000)))
    assert not isinstance(ok, ErrorReply), ok


# ---- LMCache worker sockets ---------------------------------------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.chunks: dict[str, set[int]] = {}

    def lmcache_admit(self, iid: str, hs: object) -> None:
        self.chunks.setdefault(iid, set()).update(hs)  # type: ignore[arg-type]

    def lmcache_evict(self, iid: str, hs: object) -> None:
        self.chunks.setdefault(iid, set()).difference_update(hs)  # type: ignore[arg-type]

    def lmcache_cleared(self, iid: str) -> None:
        self.chunks[iid] = set()

    def lmcache_worker_seen(self, iid: str) -> None:
        pass


def _server(sink: _Sink | None = None, **kw: object) -> LMCacheWorkerServer:
    return LMCacheWorkerServer(_Sink() if sink is None else sink,  # type: ignore[arg-type]
                               resolve_instance=lambda lmc, _w: lmc if lmc.startswith("inst") else None,
                               full_sync_on_start=False, **kw)  # type: ignore[arg-type]


def _ask(server: LMCacheWorkerServer, msg: msgspec.Struct) -> P.ReplyMsg:
    return server._on_request_frame(P.encode(msg), False)


def _push(server: LMCacheWorkerServer, msg: msgspec.Struct) -> None:
    """One frame as the PULL socket hands it over (the handler; no socket needed)."""
    server._on_push_frame(P.encode(msg))


def _register(server: LMCacheWorkerServer, lmc: str, wid: int) -> P.ReplyMsg:
    return _ask(server, P.RegisterMsg(instance_id=lmc, worker_id=wid, ip="127.0.0.1", port=1, peer_init_url=None))


def test_full_sync_batch_count_is_bounded() -> None:
    server = _server(max_sync_batches=50_000)
    _register(server, "inst-a", 0)
    start = {"instance_id": "inst-a", "worker_id": 0, "location": "L", "total_keys": 1}
    big = _ask(server, P.FullSyncStartMsg(sync_id="s1", batch_count=20_000_000, **start))
    assert isinstance(big, P.FullSyncStartRetMsg) and not big.accepted and "batch_count" in (big.error_msg or "")
    ok = _ask(server, P.FullSyncStartMsg(sync_id="s2", batch_count=50_000, **start))
    assert isinstance(ok, P.FullSyncStartRetMsg) and ok.accepted
    for b in (0, 1, 3):
        _push(server, P.FullSyncBatchMsg(instance_id="inst-a", worker_id=0, location="L",
                                                          sync_id="s2", batch_id=b, keys=[b]))
    _push(server, P.FullSyncBatchMsg(instance_id="inst-a", worker_id=0, location="L",
                                                      sync_id="s2", batch_id=10**9, keys=[1]))
    status = _ask(server, P.FullSyncStatusMsg(instance_id="inst-a", worker_id=0, sync_id="s2"))
    assert isinstance(status, P.FullSyncStatusRetMsg)
    # A window from the first gap, not every missing batch of the 50,000.
    assert status.missing_batches[:2] == [2, 4] and len(status.missing_batches) == MISSING_WINDOW - 1
    assert server.stats["full_sync_stray"] == 1


def test_holdings_slots_are_allocated_in_constant_time_and_reused() -> None:
    h = Holdings(max_slots=2)
    a, b = ("x", 0, "L"), ("x", 1, "L")
    assert h.bit(a) == 1 and h.bit(b) == 2
    with pytest.raises(SlotsExhausted):
        h.apply(("x", 2, "L"), [(True, 5)])
    h.apply(a, [(True, 7)])
    assert h.drop(lambda s: s == a) == [7]
    assert h.bit(("x", 2, "L")) == 1  # the freed bit, not a wider mask


def test_ghost_workers_are_capped_and_expire() -> None:
    server = _server(max_workers=10, max_sources_per_instance=4, worker_timeout_s=0.05)
    for i in range(30):  # ids nothing maps to
        _push(server, P.BatchedKVOperationMsg(
            instance_id=f"ghost-{i}", worker_id=i, location="L",
            operations=[P.KVOpEvent(op_type="admit", key=i, seq_num=0)]))
    assert len(server.workers()) == 10 and server.stats["workers_refused"] == 20
    # Real workers have a share of their own: the ghosts do not lock them out.
    assert isinstance(_register(server, "inst-a", 0), P.RegisterRetMsg)
    for wid in range(1, 6):
        _register(server, "inst-a", wid)
    assert sum(w.instance_id == "inst-a" for w in server.workers()) == 4
    time.sleep(0.1)
    # Silent ghosts go; a mapped worker without heartbeats stays (silence says nothing then).
    assert server.sweep() == 10
    assert {(w.lmcache_instance_id, w.worker_id) for w in server.workers()} == {("inst-a", k) for k in range(4)}
    assert len(server.workers()) == 4


def test_deregistration_frees_the_workers_source_slot() -> None:
    sink = _Sink()
    server = _server(sink, max_sources_per_instance=1)
    _register(server, "inst-a", 0)
    ops = [P.KVOpEvent(op_type="admit", key=9, seq_num=0)]
    _push(server, P.BatchedKVOperationMsg(instance_id="inst-a", worker_id=0, location="L", operations=ops))
    assert sink.chunks["inst-a"] == {9}
    _push(server, P.DeRegisterMsg(instance_id="inst-a", worker_id=0, ip="x", port=1))
    assert sink.chunks["inst-a"] == set()
    _register(server, "inst-a", 1)
    _push(server, P.BatchedKVOperationMsg(instance_id="inst-a", worker_id=1, location="L", operations=ops))
    assert sink.chunks["inst-a"] == {9} and server.stats["sources_refused"] == 0


def test_lmcache_deep_nesting_is_a_protocol_error() -> None:
    for frame in (b"\x91" * 100_000 + b"\xc0", b"\x81\xa1a" * 100_000 + b"\x01"):
        with pytest.raises(P.ProtocolError):
            P.decode(frame)


# ---- vLLM KV events -------------------------------------------------------------------------------


def test_deep_nesting_in_kv_payload_is_a_payload_error() -> None:
    with pytest.raises(PayloadError):
        decode_payload(b"\x91" * 100_000 + b"\xc0")
    def batch_with_nested_event(depth: int) -> bytes:
        good = _enc(_stored([5], list(range(16))))
        return _enc([1.0, [], 0])[:-2] + b"\x92" + b"\x81\xa4type" + b"\x91" * depth + b"\xc0" + good + b"\x00"

    with pytest.raises(PayloadError):  # too deep to even skip: the whole frame is undecodable
        decode_payload(batch_with_nested_event(100_000))
    batch = decode_payload(batch_with_nested_event(300))  # skippable: that event alone is dropped
    assert [type(e).__name__ for e in batch.events] == ["DroppedEvent", "BlockStored"]


def _stored(hashes: list[int], tokens: list[int]) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
            "block_size": 16, "medium": "GPU"}


class _Publisher:
    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.port = free_port()
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.seq = 0

    async def send(self, events: list[object]) -> None:
        payload = _enc([time.time(), events, 0])
        await self.sock.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


async def _subscribed(**kw: object) -> tuple[zmq.asyncio.Context, _Publisher, VllmEventSubscriber, TierIndex, asyncio.Task[None]]:
    ctx = zmq.asyncio.Context()
    pub = _Publisher(ctx)
    index = TierIndex(16, 256, fast_root=1)
    index.register_instance("a")
    sub = VllmEventSubscriber(f"tcp://127.0.0.1:{pub.port}", "a", index, bind=False, ctx=ctx, **kw)  # type: ignore[arg-type]
    task = asyncio.create_task(sub.run())
    assert (await asyncio.wait_for(pub.sock.recv(), 5))[:1] == b"\x01"
    return ctx, pub, sub, index, task


async def _close(ctx: zmq.asyncio.Context, pub: _Publisher, sub: VllmEventSubscriber, task: asyncio.Task[None]) -> None:
    await sub.close()
    await asyncio.gather(task, return_exceptions=True)
    pub.sock.close(linger=0)
    ctx.destroy(linger=0)


async def test_token_id_out_of_range_drops_that_event_only() -> None:
    ctx, pub, sub, index, task = await _subscribed()
    try:
        await pub.send([_stored([11, 12], list(range(32)))])
        await wait_for(lambda: index.gpu_blocks_of("a") == 2, what="first blocks")
        await pub.send([_stored([21], [1 << 32] * 16), _stored([22], [-1] * 16), _stored([13], list(range(32, 48)))])
        await wait_for(lambda: sub.stats.last_seq == 1, what="second batch")
        # The bad events are dropped alone; the instance keeps what it had plus the good one.
        assert index.gpu_blocks_of("a") == 3
        assert sub.stats.events["malformed"] == 2 and sub.stats.sink_errors == 0
    finally:
        await _close(ctx, pub, sub, task)


async def test_events_per_batch_and_blocks_per_event_are_bounded() -> None:
    ctx, pub, sub, index, task = await _subscribed(max_events_per_batch=100, max_blocks_per_event=4)
    try:
        removed = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
        await pub.send([removed] * 101)
        await wait_for(lambda: sub.stats.oversize_batches == 1, what="oversize batch refused")
        # Refused from its header alone: a frame announcing 10^9 events is never decoded.
        claim = b"\x93\xcb" + b"\x00" * 8 + b"\xdd" + (10**9).to_bytes(4, "big") + b"\x90" * 10
        await pub.sock.send_multipart([b"kv", (99).to_bytes(8, "big"), claim])
        await wait_for(lambda: sub.stats.oversize_batches == 2, what="announced oversize batch refused")
        assert sub.stats.decode_errors == 0
        await pub.send([_stored(list(range(1, 6)), [1] * 80), _stored([7], [2] * 16)])
        await wait_for(lambda: sub.stats.last_seq == 1, what="next batch")
        assert index.gpu_blocks_of("a") == 1 and sub.stats.events["malformed"] == 1
    finally:
        await _close(ctx, pub, sub, task)


# ---- in-flight load -------------------------------------------------------------------------------


async def test_an_idle_controller_expires_requests_never_reported_done() -> None:
    from smetric_lmc.controller.app import ControllerApp

    cfg = {"model": "m", "instances": [{"id": "a", "http": "http://127.0.0.1:9"}],
           "server": {"route_url": "tcp://127.0.0.1:*", "metrics_port": 0},
           "load": {"metrics_poll_s": 0, "instance_timeout_s": 0, "lost_done_grace_s": 0.3}}
    app = ControllerApp(parse_config(cfg), enable_metrics_http=False)
    await app.start()
    try:
        for i in range(5000):  # then no more routes: only the maintain loop can expire them
            app.load.on_route(f"lost-{i}", "a", 10)
        await asyncio.sleep(1.0)
        assert len(app.load) == 0 and app.load.stats["expired"] == 5000
    finally:
        await app.close()


def test_in_flight_requests_expire_after_the_grace_period() -> None:
    now = [0.0]
    load = LoadTracker(clock=lambda: now[0], expire_s=30.0)
    for i in range(1000):
        load.on_route(f"lost-{i}", "a", 10)
    load.on_route("done-early", "a", 10)
    load.on_done("done-early")
    now[0] = 31.0
    load.on_route("fresh", "b", 10)  # a route expires a few due entries (bounded work per route)
    assert load.stats["expired"] == 8 and load.expire_due()
    assert load.expire() == 992  # the controller's maintain loop: the rest, a slice at a time
    assert len(load) == 1 and load.in_flight("a") == 0 and load.unprefilled("a") == 0
    assert load.stats["expired"] == 1000 and load.instance_of("fresh") == "b"
    # A re-routed request is timed from its last route.
    load.on_route("fresh", "a", 10)
    now[0] = 62.0
    assert load.expire() == 1 and len(load) == 0


# ---- CURVE ------------------------------------------------------------------------------------------


def test_curve_keys_are_checked_as_config() -> None:
    public, secret = (k.decode() for k in zmq.curve_keypair())
    other, _ = (k.decode() for k in zmq.curve_keypair())
    bad = [
        {"curve_secret_key": secret, "curve_public_key": public},  # no allow-list
        {"curve_secret_key": "short", "curve_public_key": public, "curve_client_keys": ["*"]},
        {"curve_secret_key": secret, "curve_public_key": other, "curve_client_keys": ["*"]},
        {"curve_secret_key": secret, "curve_public_key": public, "curve_client_keys": ["~" * 40]},
        {"curve_secret_key": secret, "curve_client_keys": ["*"]},
    ]
    for server in bad:
        with pytest.raises(ConfigError, match="server"):
            parse_config({"server": server})
    ok = parse_config({"server": {"curve_secret_key": secret, "curve_public_key": public, "curve_client_keys": [other]}})
    assert ok.server.curve_client_keys == [other]


def test_limits_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="limits"):
        parse_config({"limits": {"kv_max_events_per_batch": 0}})


# ---- part supervision -------------------------------------------------------------------------------


async def test_restart_backoff_starts_over_after_a_recovery(caplog: pytest.LogCaptureFixture) -> None:
    # A part that ran a while before each crash restarts at the shortest backoff every time;
    # before, six crashes spread over hours left an engine's ingest 10 s behind each time.
    from smetric_lmc.controller.tasks import Supervisor

    supervisor = Supervisor(asyncio.Event())
    supervisor.recovered_after_s = 0.05
    runs = 0

    async def part() -> None:
        nonlocal runs
        runs += 1
        if runs > 3:
            return
        await asyncio.sleep(0.1)  # longer than recovered_after_s
        raise RuntimeError("peer damage")

    with caplog.at_level("ERROR", logger="smetric_lmc.controller.tasks"):
        await asyncio.wait_for(supervisor.supervise("p", part), 10)
    delays = [r.getMessage().rsplit("=", 1)[1] for r in caplog.records if "part crashed" in r.getMessage()]
    assert delays == ["0.5", "0.5", "0.5"]
