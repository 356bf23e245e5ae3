"""LMCacheWorkerServer over real ZMQ sockets: recorded LMCache exchanges, error paths, upstream."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import kit
import msgspec
import pytest
import zmq
import zmq.asyncio
from kit.lmcache_venv import require_lmcache_python
from lmcache_helpers import ANY, C0, C1, C2, C3, RecordingSink, Worker, hb, ops, push, reg, serving, until

from smetric_lmc.controller import lmcache_proto as P
from smetric_lmc.controller.lmcache_server import LMCacheWorkerServer


@pytest.fixture
def rec(shared: Path) -> dict:
    p = shared / "fixtures" / "lmcache_worker_messages.json"
    if not p.exists():
        pytest.skip(f"{p} missing")
    return json.loads(p.read_text())



# ---- recorded exchanges, replayed byte for byte ----


async def test_replay_recorded_exchanges(ctx: zmq.asyncio.Context, rec: dict) -> None:
    sink = RecordingSink()
    async with serving(ctx, sink, heartbeat_url=ANY, heartbeat_advertise="127.0.0.1:18082") as (server, w):
        for ex in rec["exchanges"]:
            frames = [bytes.fromhex(h) for h in ex["sent_frames_hex"]]
            if ex["kind"] == "push":
                await push(server, w, frames)
                continue
            assert frames[0] == b""
            got = await w.ask(frames[1], heartbeat=ex["socket"] == "heartbeat")
            assert got == bytes.fromhex(ex["reply_frames_hex"][1]), ex["note"]

    assert sink.changes() == [
        ("cleared", "vllm-a"),                     # register A
        ("admit", "vllm-a", sorted([C0, C1, C2])),  # C3 admitted and evicted in the same batch
        ("cleared", "vllm-a"),                     # full sync start
        ("admit", "vllm-a", sorted([C0, C1, C2])),  # full sync batch
        ("cleared", "vllm-b"),                     # register B
        ("admit", "vllm-b", [C0]),
        ("admit", "vllm-b", [C1]),                 # the JSON-encoded PUSH
        ("cleared", "vllm-b"),                     # deregister B
    ]
    assert {c[1] for c in sink.calls if c[0] == "seen"} == {"vllm-a", "vllm-b", "vllm-z"}
    # Same registry as LMCache's controller after these exchanges.
    after = rec["registry_after_exchanges"]
    ws = {(x.lmcache_instance_id, x.worker_id): x for x in server.workers()}
    assert set(ws) == {(i, int(k)) for i, d in after.items() for k in d}
    assert sink.held()["vllm-a"] == set(after["vllm-a"]["0"]["LocalCPUBackend"])
    assert ws[("vllm-a", 0)].sync_state == "completed"
    assert ws[("vllm-z", 3)].registered and ws[("vllm-z", 3)].port == 8599
    st = server.stats
    assert st["decode_errors"] == 1 and st["wrong_socket"] == 1 and st["internal_errors"] == 0
    assert st["full_sync_completed"] == 1 and st["unknown_heartbeats"] == 1


async def test_register_advertises_bound_heartbeat_port(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx, RecordingSink(), heartbeat_url=ANY) as (server, w):
        ret = await w.call(reg("a"))
        port = server.endpoints["heartbeat"].rsplit(":", 1)[1]
        assert ret == P.RegisterRetMsg(extra_config={"heartbeat_url": f"127.0.0.1:{port}"})
        # Heartbeats are also answered on the main reply socket, as upstream does.
        assert isinstance(await w.call(hb("a")), P.HeartbeatRetMsg)


async def test_without_heartbeat_socket_register_has_no_url(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx, RecordingSink()) as (server, w):
        assert await w.call(reg("a")) == P.RegisterRetMsg(extra_config={})


# ---- semantics beyond the recording ----


async def test_sources_per_worker_and_location(ctx: zmq.asyncio.Context) -> None:
    sink = RecordingSink()
    async with serving(ctx, sink, full_sync_on_start=False) as (server, w):
        await w.call(reg("a", 0))
        await w.call(reg("a", 1))
        sink.calls.clear()
        await push(server, w, [ops("a", [("admit", 1), ("admit", 2)]),
                               ops("a", [("admit", 2)], loc="LocalDiskBackend"),
                               ops("a", [("admit", 1)], wid=1)])
        assert sink.changes() == [("admit", "a", [1, 2])]
        # Chunk 2 is still on disk, chunk 1 still on rank 1: nothing leaves the instance.
        await push(server, w, [ops("a", [("evict", 1), ("evict", 2)], seq0=2)])
        assert sink.changes() == [("admit", "a", [1, 2])]
        await push(server, w, [ops("a", [("evict", 2)], loc="LocalDiskBackend", seq0=1)])
        assert sink.changes()[-1] == ("evict", "a", [2])
        # Rank 1 restarts: its chunk 1 goes, the instance then holds nothing -> cleared.
        await w.call(reg("a", 1))
        assert sink.changes()[-1] == ("cleared", "a")
        assert server.stats["seq_gaps"] == 0
        await push(server, w, [ops("a", [("admit", 9)], seq0=10)])
        assert server.stats["seq_gaps"] == 1


async def test_full_sync_flow_and_edge_cases(ctx: zmq.asyncio.Context) -> None:
    sink = RecordingSink()
    loc = "LocalCPUBackend"
    async with serving(ctx, sink, heartbeat_url=ANY) as (server, w):
        start = P.FullSyncStartMsg(instance_id="a", worker_id=0, location=loc, sync_id="s1",
                                   total_keys=4, batch_count=2)
        # Unknown worker: rejected with LMCache's text.
        r = await w.call(start)
        assert isinstance(r, P.FullSyncStartRetMsg) and not r.accepted and "worker not found" in r.error_msg
        await w.call(reg("a"))
        await w.call(reg("b"))
        await push(server, w, [ops("a", [("admit", 100)])])
        assert (await w.call(start)).accepted
        assert sink.changes()[-1] == ("cleared", "a")
        # Another sync id while syncing is refused; the same one is accepted again.
        other = P.FullSyncStartMsg(instance_id="a", worker_id=0, location=loc, sync_id="s2",
                                   total_keys=0, batch_count=1)
        assert not (await w.call(other)).accepted
        # Incremental ops during the sync are discarded; stray sync ids are counted.
        await push(server, w, [
            ops("a", [("admit", 555)], seq0=1),
            P.encode(P.FullSyncBatchMsg(instance_id="a", worker_id=0, location=loc, sync_id="zz",
                                        batch_id=0, keys=[777])),
            P.encode(P.FullSyncBatchMsg(instance_id="a", worker_id=0, location=loc, sync_id="s1",
                                        batch_id=1, keys=[3, 4])),
        ])
        assert server.stats["kv_ops_during_sync"] == 1 and server.stats["full_sync_stray"] == 1
        status = await w.call(P.FullSyncStatusMsg(instance_id="a", worker_id=0, sync_id="s1"))
        assert status == P.FullSyncStatusRetMsg(sync_id="s1", is_complete=False, global_progress=0.5,
                                                can_exit_freeze=False, missing_batches=[0])
        # While not complete, b (never synced) is still asked to sync after our start.
        hbr = await w.call(hb("b"), heartbeat=True)
        assert hbr == P.HeartbeatRetMsg(commands=[P.FullSyncCommand(reason="controller_restart")])
        await push(server, w, [
            P.encode(P.FullSyncBatchMsg(instance_id="a", worker_id=0, location=loc, sync_id="s1",
                                        batch_id=0, keys=[1, 2])),
            P.encode(P.FullSyncEndMsg(instance_id="a", worker_id=0, location=loc, sync_id="s1",
                                      actual_total_keys=4)),
        ])
        assert sink.held()["a"] == {1, 2, 3, 4}
        status = await w.call(P.FullSyncStatusMsg(instance_id="a", worker_id=0, sync_id="s1"))
        # b has no sync state, so counts as ready: 2/2 >= 0.8 and the global request ends.
        assert status == P.FullSyncStatusRetMsg(sync_id="s1", is_complete=True, global_progress=1.0,
                                                can_exit_freeze=True, missing_batches=[])
        assert await w.call(hb("b"), heartbeat=True) == P.HeartbeatRetMsg()
        await push(server, w, [ops("a", [("admit", 5)], seq0=50)])
        assert sink.held()["a"] == {1, 2, 3, 4, 5}


async def test_full_sync_timeout_asks_for_retry(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx, RecordingSink(), full_sync_timeout_s=0.05, full_sync_on_start=False) as (server, w):
        await w.call(reg("a"))
        await w.call(P.FullSyncStartMsg(instance_id="a", worker_id=0, location="L", sync_id="s",
                                        total_keys=1, batch_count=1))
        assert await w.call(hb("a")) == P.HeartbeatRetMsg()
        await asyncio.sleep(0.1)
        assert await w.call(hb("a")) == P.HeartbeatRetMsg(
            commands=[P.FullSyncCommand(reason="sync_failed_retry")])


async def test_unresolved_instance_is_counted_and_ignored(ctx: zmq.asyncio.Context) -> None:
    sink = RecordingSink()
    async with serving(ctx, sink, resolve_instance=lambda iid, wid: None if iid == "ghost" else f"i-{iid}") as (server, w):
        assert isinstance(await w.call(reg("ghost")), P.RegisterRetMsg)
        assert isinstance(await w.call(reg("a")), P.RegisterRetMsg)
        await push(server, w, [ops("ghost", [("admit", 1), ("admit", 2)]), ops("a", [("admit", 3)])])
        assert server.stats["kv_ops_unresolved"] == 2
        assert sink.changes() == [("cleared", "i-a"), ("admit", "i-a", [3])]
        assert await w.call(hb("ghost")) == P.HeartbeatRetMsg(
            commands=[P.FullSyncCommand(reason="controller_restart")])
        assert {x.instance_id for x in server.workers()} == {None, "i-a"}


async def test_ops_before_registration_apply_then_heartbeat_reregisters(ctx: zmq.asyncio.Context) -> None:
    # After a controller restart workers keep PUSHing; their next heartbeat re-registers them.
    sink = RecordingSink()
    async with serving(ctx, sink, heartbeat_url=ANY) as (server, w):
        await push(server, w, [ops("a", [("admit", 7)], seq0=40)])
        assert sink.changes() == [("admit", "a", [7])]
        assert not server.workers()[0].registered
        assert await w.call(hb("a"), heartbeat=True) == P.HeartbeatRetMsg(
            commands=[P.FullSyncCommand(reason="worker_re_registered")])
        assert server.workers()[0].registered


async def test_p2p_lookup_prefers_longest_prefix_and_needs_peer_url(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx, RecordingSink()) as (server, w):
        await w.call(reg("a", peer="10.0.0.1:1"))
        await w.call(reg("b", peer="10.0.0.2:1"))
        await w.call(reg("c"))  # no peer url: never a P2P source
        await w.call(reg("me", peer="10.0.0.9:1"))
        await push(server, w, [ops("a", [("admit", 1)]), ops("b", [("admit", 1), ("admit", 2)]),
                               ops("c", [("admit", 1), ("admit", 2), ("admit", 3)]),
                               ops("me", [("admit", 1), ("admit", 2), ("admit", 3), ("admit", 4)])])

        def look(hs: list[int]) -> P.BatchedP2PLookupMsg:
            return P.BatchedP2PLookupMsg(hashes=hs, instance_id="me", worker_id=0)

        assert await w.call(look([1, 2, 3, 4])) == P.BatchedP2PLookupRetMsg(
            layout_info=[("b", "LocalCPUBackend", 2, "10.0.0.2:1")])
        none = P.BatchedP2PLookupRetMsg(layout_info=[("", "", 0, "")])
        assert await w.call(look([9, 1])) == none
        assert await w.call(look([])) == none


# ---- bad input never kills the server ----


async def test_garbage_on_pull_is_dropped_and_counted(ctx: zmq.asyncio.Context) -> None:
    sink = RecordingSink()
    async with serving(ctx, sink, max_frame_bytes=4096) as (server, w):
        bad = [
            b"", b"\xff\x00garbage", b"\xc0", b"{\"type\": \"BatchedKVOperationMsg\"",
            msgspec.msgpack.encode({"type": "Nope"}),
            msgspec.msgpack.encode({"type": "BatchedKVOperationMsg", "instance_id": "a", "worker_id": "0",
                                    "location": "L", "operations": []}),
            msgspec.msgpack.encode({"type": "BatchedKVOperationMsg", "instance_id": "a", "worker_id": 0,
                                    "location": "L", "operations": [{"op_type": "admit", "key": 1.5,
                                                                      "seq_num": 0}]}),
        ]
        await push(server, w, bad)
        assert server.stats["decode_errors"] == len(bad)
        # Request types on PULL are the wrong socket: dropped (LMCache ignores them too).
        await push(server, w, [P.encode(reg("a")), P.encode(P.ErrorMsg(error="x"))])
        assert server.stats["wrong_socket"] == 2
        # A frame beyond the limit makes libzmq drop that peer; the server carries on.
        big = Worker(ctx, server.endpoints)
        await big.push.send_multipart([b"\x00" * 8192])
        await asyncio.sleep(0.1)
        big.close()
        await w.call(reg("a"))
        await push(server, w, [ops("a", [("admit", 1)])])
        assert sink.changes()[-1] == ("admit", "a", [1])
        assert server.stats["internal_errors"] == 0


async def test_bad_requests_get_error_replies(ctx: zmq.asyncio.Context) -> None:
    async with serving(ctx, RecordingSink(), heartbeat_url=ANY) as (server, w):
        async def err(payload: bytes, heartbeat: bool = False) -> str:
            r = P.decode(await w.ask(payload, heartbeat=heartbeat))
            assert isinstance(r, P.ErrorMsg)
            return r.error

        assert "truncated" in (await err(b"")).lower()
        assert "Invalid value 'Nope'" in await err(msgspec.msgpack.encode({"type": "Nope"}))
        assert "Expected `int`, got `str`" in await err(msgspec.msgpack.encode(
            {"type": "RegisterMsg", "instance_id": "a", "worker_id": "x", "ip": "h", "port": 1,
             "peer_init_url": None}))
        assert "JSON" in await err(b"{oops")
        assert await err(P.encode(P.ErrorMsg(error="x"))) == P.unknown_type_error("ErrorMsg")
        assert await err(msgspec.msgpack.encode({"type": "PinMsg", "event_id": "e", "instance_id": "a",
                                                 "location": "L", "tokens": []})) \
            == P.unknown_type_error("PinMsg")
        assert await err(P.encode(reg("a")), heartbeat=True) == \
            "Expected HeartbeatMsg, got <class 'lmcache.v1.cache_controller.message.RegisterMsg'>"
        assert "Expected `object`" in await err(b"\xc0", heartbeat=True)
        # A JSON request is answered in msgpack, like upstream.
        r = P.decode(await w.ask(P.encode_json(reg("j"))))
        assert isinstance(r, P.RegisterRetMsg)
        # A raw DEALER without the empty delimiter still gets an answer in its own framing.
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.endpoints["reply"])
        await raw.send(b"\x01")
        frames = await asyncio.wait_for(raw.recv_multipart(), 5)
        raw.close()
        assert len(frames) == 1 and isinstance(P.decode(frames[0]), P.ErrorMsg)
        assert server.stats["internal_errors"] == 0


async def test_sink_exception_does_not_kill_server(ctx: zmq.asyncio.Context) -> None:
    class Exploding(RecordingSink):
        def lmcache_admit(self, instance_id: str, chunk_hashes: Iterable[int]) -> None:
            raise RuntimeError("index bug")

    async with serving(ctx, Exploding()) as (server, w):
        await w.call(reg("a"))
        await push(server, w, [ops("a", [("admit", 1)])])
        assert server.stats["internal_errors"] == 1
        assert isinstance(await w.call(hb("a")), P.HeartbeatRetMsg)


# ---- forwarding to a real LMCache controller (LMCacheControllerManager, CPU, subprocess) ----

_UPSTREAM = r"""
import asyncio, json, sys, logging
logging.disable(logging.CRITICAL)
import zmq, zmq.asyncio
from lmcache.v1.cache_controller.controller_manager import LMCacheControllerManager
pull, reply, inspect = sys.argv[1:4]
async def main():
    mgr = LMCacheControllerManager({"pull": pull, "reply": reply}, 0, 30)
    task = asyncio.ensure_future(mgr.start_all())
    # Test-only probe: dumps the upstream registry (instance -> worker -> location -> keys).
    rep = zmq.asyncio.Context.instance().socket(zmq.REP)
    rep.bind("tcp://" + inspect)
    print("ready", flush=True)
    while True:
        cmd = await rep.recv()
        reg = mgr.reg_controller.registry
        out = {iid: {str(wid): {loc: sorted(keys) for loc, keys in wn.kv_store.items()}
                     for wid, wn in inode.workers.items()}
               for iid, inode in reg.instances.items()}
        await rep.send(json.dumps(out).encode())
        if cmd == b"stop":
            break
asyncio.run(main())
"""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.integration
async def test_forwarding_to_real_lmcache_controller(ctx: zmq.asyncio.Context) -> None:
    py = require_lmcache_python()
    p_pull, p_reply, p_inspect = _free_ports(3)
    proc = subprocess.Popen(
        [str(py), "-c", _UPSTREAM, f"127.0.0.1:{p_pull}", f"127.0.0.1:{p_reply}", f"127.0.0.1:{p_inspect}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    probe = None
    sink = RecordingSink()
    # Our own restart request is off, so any FullSyncCommand the worker gets comes from upstream.
    server = LMCacheWorkerServer(sink, pull_url=ANY, reply_url=ANY, heartbeat_url=ANY,
                                 full_sync_on_start=False,
                                 upstream_pull_url=f"tcp://127.0.0.1:{p_pull}",
                                 upstream_reply_url=f"tcp://127.0.0.1:{p_reply}")
    w = None
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == b"ready", proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        probe = ctx.socket(zmq.REQ)
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(f"tcp://127.0.0.1:{p_inspect}")

        async def upstream_registry() -> dict:
            await probe.send(b"dump")
            return json.loads(await asyncio.wait_for(probe.recv(), 5))

        await server.start()
        w = Worker(ctx, server.endpoints)
        reply = await w.call(reg("vllm-a", peer="127.0.0.1:8600"))
        # The worker gets OUR reply (our heartbeat URL), not the upstream's.
        assert reply == P.RegisterRetMsg(
            extra_config={"heartbeat_url": server.endpoints["heartbeat"].split("://")[1]})
        await push(server, w, [ops("vllm-a", [("admit", C0), ("admit", C1), ("admit", C2),
                                              ("evict", C1)])])

        async def upstream_has(keys: list[int]) -> None:
            for _ in range(200):
                got = (await upstream_registry()).get("vllm-a", {}).get("0", {}).get("LocalCPUBackend")
                if got == sorted(keys):
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"upstream registry never reached {keys}: {await upstream_registry()}")

        await upstream_has([C0, C2])
        assert sink.held()["vllm-a"] == {C0, C2}
        # Upstream just started, so its heartbeat reply asks for a full sync; we relay it on the
        # worker's next heartbeat (our own state needs none).
        first = await w.call(hb("vllm-a"), heartbeat=True)
        assert first == P.HeartbeatRetMsg()
        await until(lambda: server.stats["upstream_replies"] >= 2)
        relayed = await w.call(hb("vllm-a"), heartbeat=True)
        assert relayed == P.HeartbeatRetMsg(commands=[P.FullSyncCommand(reason="controller_restart")])
        # The worker's full sync then reaches both controllers.
        loc = "LocalCPUBackend"
        start = P.FullSyncStartMsg(instance_id="vllm-a", worker_id=0, location=loc, sync_id="s",
                                   total_keys=2, batch_count=1)
        assert (await w.call(start)).accepted
        await push(server, w, [
            P.encode(P.FullSyncBatchMsg(instance_id="vllm-a", worker_id=0, location=loc, sync_id="s",
                                        batch_id=0, keys=[C2, C3])),
            P.encode(P.FullSyncEndMsg(instance_id="vllm-a", worker_id=0, location=loc, sync_id="s",
                                      actual_total_keys=2)),
        ])
        await upstream_has([C2, C3])
        assert sink.held()["vllm-a"] == {C2, C3}
        await push(server, w, [P.encode(P.DeRegisterMsg(instance_id="vllm-a", worker_id=0,
                                                        ip="127.0.0.1", port=8500))])
        for _ in range(200):
            if "vllm-a" not in await upstream_registry():
                break
            await asyncio.sleep(0.02)
        assert "vllm-a" not in await upstream_registry()
        st = server.stats
        assert st["upstream_dropped"] == 0 and st["upstream_errors"] == 0
        assert st["upstream_forwarded"] == 7  # 4 requests + 3 PUSH multiparts
    finally:
        if w is not None:
            w.close()
        await server.close()
        if probe is not None:
            probe.close(linger=0)
        proc.kill()
        proc.wait(timeout=10)


async def test_upstream_down_does_not_block_workers(ctx: zmq.asyncio.Context) -> None:
    p_pull, p_reply = _free_ports(2)
    sink = RecordingSink()
    async with serving(ctx, sink, upstream_pull_url=f"tcp://127.0.0.1:{p_pull}", upstream_reply_url=f"tcp://127.0.0.1:{p_reply}") as (server, w):
        # Answered and applied while nothing listens upstream (forwarding never waits for it).
        assert isinstance(await w.call(reg("a")), P.RegisterRetMsg)
        await push(server, w, [ops("a", [("admit", 1)])])
        assert sink.changes()[-1] == ("admit", "a", [1])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


# ---- LMCache's own lookup, for the benchmark reference script ----


@pytest.mark.integration
def test_reference_script_shows_first_holder_crediting() -> None:
    py = require_lmcache_python()
    script = Path(kit.__file__).with_name("lmcache_reference.py")
    spec = {"repeat": 5, "admits": [{"instance": "A", "hashes": [1, 3]},
                                    {"instance": "B", "hashes": [1, 2, 3, 4]}],
            "lookups": [[1, 2, 3, 4, 5], [9, 1]]}
    proc = subprocess.run([str(py), str(script)], input=json.dumps(spec).encode(),
                          capture_output=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    out = json.loads(proc.stdout)
    assert out["lmcache_version"] == "0.5.6" and out["chunks_indexed"] == 6
    first, miss = out["lookups"]
    # Chunks 0 and 2 go to A (registered first), 1 and 3 to B; each entry is the end of the last
    # chunk credited to it: A gets 768 although its own contiguous prefix is one chunk (256).
    assert first["answer"] == {"A": ["LocalCPUBackend", 768], "B": ["LocalCPUBackend", 1024]}
    assert miss["answer"] == {}
    assert first["p50_us"] > 0 and first["p99_us"] >= first["p50_us"]
