"""The route service keeps its event loop responsive: large frames are prepared off the loop and a
wake-up yields after a payload budget, not only after a request count. Stall figures (ms) are
measured by ``bench/soak.py``; these tests check the behaviour that keeps them low."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio
from lmcache_helpers import RecordingSink
from service_helpers import BS, PROMPT, ROOT, make_core, seed  # noqa: E402

from smetric_lmc.controller.route_prep import FramePrep
from smetric_lmc.controller.service import RouteService
from smetric_lmc.controller.tasks import LoopBudget
from smetric_lmc.hashing import HashSettings
from smetric_lmc.wire import ErrorReply, RouteDecision, RouteRequest, decode_reply

_enc = msgspec.msgpack.encode


def big_route(rid: str, n_tokens: int) -> bytes:
    return _enc({"type": "route", "request_id": rid, "token_ids": [7] * n_tokens})


@contextlib.asynccontextmanager
async def serving(core: object, n_clients: int = 1) -> AsyncIterator[tuple[RouteService, list[zmq.asyncio.Socket]]]:
    """A running route service on loopback and ``n_clients`` DEALER sockets connected to it."""
    svc = RouteService(core, "tcp://127.0.0.1:*")  # type: ignore[arg-type]
    svc.bind()
    ctx = zmq.asyncio.Context()
    task = asyncio.create_task(svc.run())
    socks = [ctx.socket(zmq.DEALER) for _ in range(n_clients)]
    for sock in socks:
        sock.connect(svc.endpoint or "")
    try:
        yield svc, socks
    finally:
        await svc.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)


async def test_small_route_is_not_held_behind_a_large_one() -> None:
    # A 1 M-token route (4 MB) costs ~100 ms to decode and hash; prepared in the worker, a small
    # route sent right after it by another client is answered first. On the loop (in order) the
    # large one would always come back first.
    core = make_core()
    seed(core, "i1", PROMPT)
    async with serving(core, 2) as (svc, (big, small)):
        # Warm the worker (spawn start-up) so the race below is between preparing and routing.
        await big.send_multipart([b"", big_route("warm", 300_000)])
        assert isinstance(decode_reply((await asyncio.wait_for(big.recv_multipart(), 30))[-1]), RouteDecision)
        order: list[str] = []

        async def read(sock: zmq.asyncio.Socket, name: str) -> None:
            reply = decode_reply((await asyncio.wait_for(sock.recv_multipart(), 30))[-1])
            assert isinstance(reply, RouteDecision), reply
            order.append(name)

        await big.send_multipart([b"", big_route("big", 1_000_000)])
        await small.send_multipart([b"", _enc({"type": "route", "request_id": "small", "token_ids": PROMPT})])
        await asyncio.gather(read(big, "big"), read(small, "small"))
        assert order == ["small", "big"]
        assert svc.counters["offloaded"] == 2
        assert core.load.instance_of("big") is not None  # routed and counted like any other


@pytest.mark.parametrize("want_chunks", [False, True])
def test_worker_prepares_what_the_loop_would(want_chunks: bool) -> None:
    # The same inputs (fast chain, LMCache chunk chain, token count) whether hashed in the worker
    # process or on the loop; refusals keep their code and request id.
    core = make_core(want_chunks=want_chunks)
    tokens = list(range(5_000))
    prep = FramePrep(core.hashing, core.limits)

    async def go() -> None:
        try:
            out = await prep.prepare(_enc({"type": "route", "request_id": "r", "token_ids": tokens}), ROOT)
            assert out[0] == "route"
            want = core.route_inputs(RouteRequest(request_id="r", token_ids=tokens))
            assert (out[2], out[3], out[4]) == want
            bad = await prep.prepare(_enc({"type": "route", "request_id": "r2", "token_ids": [1, -5]}), ROOT)
            assert bad[:2] == ("error", "bad_request") and bad[3] == "r2" and bad[4] is True
            deep = await prep.prepare(b"\x91" * 100_000 + b"\xc0", ROOT)
            assert deep[:2] == ("error", "bad_request") and deep[4] is False
        finally:
            prep.close()

    asyncio.run(go())


async def test_offloaded_lora_route_hashes_under_the_adapter_root() -> None:
    core = make_core()
    core.index.register_adapter("my-lora")
    tokens = list(range(100_000))  # over OFFLOAD_BYTES once encoded
    async with serving(core) as (svc, (sock,)):
        frame = _enc({"type": "route", "request_id": "l", "model": "my-lora", "token_ids": tokens})
        assert len(frame) > RouteService.OFFLOAD_BYTES
        await sock.send_multipart([b"", frame])
        reply = decode_reply((await asyncio.wait_for(sock.recv_multipart(), 30))[-1])
        assert isinstance(reply, RouteDecision)
        assert svc.counters["offloaded"] == 1
        seen: list[list[int]] = []
        orig = core.router.route if core.index_ready else core.fallback.route

        def spy(rid: str, blocks: list[int], *a: object, **kw: object) -> RouteDecision:
            seen.append(blocks)
            return orig(rid, blocks, *a, **kw)  # type: ignore[arg-type]

        core.router.route = core.fallback.route = spy  # type: ignore[method-assign]
        await sock.send_multipart([b"", frame.replace(b"\xa1l", b"\xa1m", 1)])
        await asyncio.wait_for(sock.recv_multipart(), 30)
        expect = core.route_inputs(RouteRequest(request_id="x", model="my-lora", token_ids=tokens))[0]
        assert seen == [expect]
        assert expect != core.route_inputs(RouteRequest(request_id="x", token_ids=tokens))[0]


async def test_a_wake_up_yields_after_its_payload_budget() -> None:
    # Count and time budgets out of the way: only the payload budget can make the service yield
    # while 40 queued ~100 KB requests are drained. Before the byte budget, all 40 were answered
    # in one go and a task on the same loop never ran in between.
    core = make_core()
    svc = RouteService(core, "tcp://127.0.0.1:*")
    svc.DRAIN_BUDGET = LoopBudget(items=10**9, nbytes=300_000, seconds=3600.0)  # type: ignore[misc]
    svc.bind()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(svc.endpoint or "")
    frame = big_route("r", 25_000)  # ~100 KB: answered on the loop (below OFFLOAD_BYTES)
    assert len(frame) < RouteService.OFFLOAD_BYTES
    for k in range(40):
        sock.send_multipart([b"", frame.replace(b"\xa1r", b"\xa1" + bytes([65 + k % 26]), 1)])
    time.sleep(0.5)  # let ZMQ queue them all before the service first wakes (blocks the loop on purpose)
    seen: set[int] = set()

    async def probe() -> None:
        while True:
            seen.add(svc.counters["frames"])
            await asyncio.sleep(0)

    p = asyncio.create_task(probe())
    task = asyncio.create_task(svc.run())
    try:
        got = 0
        while got < 40:
            if sock.poll(0):
                sock.recv_multipart()
                got += 1
            else:
                await asyncio.sleep(0.01)
        assert any(0 < n < 40 for n in seen), seen
    finally:
        p.cancel()
        await svc.close()
        task.cancel()
        await asyncio.gather(task, p, return_exceptions=True)
        ctx.destroy(linger=0)


def test_oversize_frame_still_refused_before_any_worker() -> None:
    core = make_core()
    svc = RouteService(core, "tcp://127.0.0.1:*", max_frame_bytes=1 << 20)
    prefix, payload, reply = svc._check_framing([b"id", b"", b"\x90" * (2 << 20)])
    assert payload is None and reply is not None
    err = decode_reply(reply[-1])
    assert isinstance(err, ErrorReply) and err.code == "too_large"
    assert HashSettings(block_size=BS, fast_root=ROOT) == core.hashing


def _serve_in_daemon(conn: object) -> None:
    async def go() -> tuple[int, int, bool]:
        async with serving(make_core()) as (svc, (sock,)):
            await sock.send_multipart([b"", big_route("d", 300_000)])
            reply = decode_reply((await asyncio.wait_for(sock.recv_multipart(), 30))[-1])
        return svc.counters["offloaded"], svc.counters["large_on_loop"], isinstance(reply, RouteDecision)

    conn.send(asyncio.run(go()))  # type: ignore[attr-defined]


def test_a_daemonic_process_answers_large_frames_on_the_loop_and_counts_them() -> None:
    # multiprocessing forbids children in a daemonic process: the worker cannot start there.
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_serve_in_daemon, args=(child,), daemon=True)
    p.start()
    assert parent.poll(60)
    assert parent.recv() == (0, 1, True)
    p.join(10)


def test_in_flight_entries_are_not_tracked_by_the_cyclic_gc() -> None:
    # Each tracked entry lengthens every full collection, which stops the event loop. The young
    # generation's count is what the collector will have to traverse: routes must not add to it.
    import gc

    from smetric_lmc.load import LoadTracker

    load = LoadTracker(expire_s=30.0)
    load.on_route("warm", "a", 100)  # the per-instance maps and the first cohort exist
    gc.disable()  # no collection may reset the count while we read it
    try:
        gc.collect()
        before = gc.get_count()[0]
        for k in range(2_000):
            load.on_route(f"r{k}", "a", 100)
        grown = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert len(load) == 2_001
    assert grown < 100, f"{grown} GC-tracked objects kept by 2,000 in-flight requests"


async def test_the_controller_freezes_its_start_up_objects_out_of_the_gc() -> None:
    import gc

    from smetric_lmc.config import parse_config
    from smetric_lmc.controller.app import ControllerApp

    cfg = {"model": "m", "instances": [{"id": "a", "http": "http://127.0.0.1:9"}],
           "server": {"route_url": "tcp://127.0.0.1:*", "metrics_port": 0},
           "load": {"metrics_poll_s": 0, "instance_timeout_s": 0}}
    gc.unfreeze()
    app = ControllerApp(parse_config(cfg), enable_metrics_http=False)
    await app.start()
    try:
        assert gc.get_freeze_count() > 0
    finally:
        await app.close()
    assert gc.get_freeze_count() == 0


async def test_lmcache_pull_yields_after_its_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the byte budget can make the PULL loop yield here; before it, 40 queued ~100 KB
    # messages were all applied before any other task on the loop ran.

    from smetric_lmc.controller import lmcache_server as L
    from smetric_lmc.controller.lmcache_server import LMCacheWorkerServer

    monkeypatch.setattr(L, "LOOP_BUDGET", LoopBudget(items=10**9, nbytes=300_000, seconds=3600.0))
    server = LMCacheWorkerServer(RecordingSink(), pull_url="tcp://127.0.0.1:*", reply_url="tcp://127.0.0.1:*",
                                 full_sync_on_start=False)  # type: ignore[arg-type]
    await server.start()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(server.endpoints["pull"])
    frame = b"\x00" * 100_000  # undecodable: counted and dropped, cheaply
    seen: set[int] = set()

    async def probe() -> None:
        while True:
            seen.add(server.stats["pull_frames"])
            await asyncio.sleep(0)

    try:
        for _ in range(40):
            push.send(frame)
        time.sleep(0.5)  # queued before the PULL loop next runs (blocks the loop on purpose)
        p = asyncio.create_task(probe())
        while server.stats["pull_frames"] < 40:
            await asyncio.sleep(0.01)
        p.cancel()
        assert any(0 < n < 40 for n in seen), seen
    finally:
        await server.close()
        ctx.destroy(linger=0)


def _prep_owner(conn: object) -> None:
    from smetric_lmc.controller.offload import _ready
    from smetric_lmc.controller.route_prep import FramePrep

    prep = FramePrep(HashSettings(block_size=BS), make_core().limits)
    prep.start()
    assert prep._pool is not None
    prep._pool.submit(_ready).result(60)
    conn.send(list(prep._pool._processes))  # type: ignore[attr-defined]
    time.sleep(3600)


def test_the_frame_worker_dies_with_a_killed_controller() -> None:
    import multiprocessing as mp
    import os
    import signal

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_prep_owner, args=(child,))
    owner.start()
    assert parent.poll(60)
    (worker,) = parent.recv()
    os.kill(owner.pid or 0, signal.SIGKILL)
    owner.join(10)

    def gone() -> bool:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{worker}/stat") as f:  # a zombie (exited, not yet reaped) is gone too
            return f.read().split()[2] == "Z"

    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = not gone()
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, "the frame worker outlived its controller"


async def test_a_large_lmcache_batch_is_applied_a_slice_at_a_time() -> None:
    # 3 slices and a bit in one BatchedKVOperationMsg: other tasks run between the slices, and
    # every operation lands, in order (the evictions at the end undo the first admits).

    from smetric_lmc.controller import lmcache_proto as P
    from smetric_lmc.controller.lmcache_kvops import OPS_SLICE
    from smetric_lmc.controller.lmcache_server import LMCacheWorkerServer

    sink = RecordingSink()
    server = LMCacheWorkerServer(sink, pull_url="tcp://127.0.0.1:*", reply_url="tcp://127.0.0.1:*",
                                 resolve_instance=lambda lmc, _w: lmc, full_sync_on_start=False)
    await server.start()
    n = 3 * OPS_SLICE + 5
    ops = [P.KVOpEvent(op_type="admit", key=k + 1, seq_num=k) for k in range(n)]
    ops += [P.KVOpEvent(op_type="evict", key=k + 1, seq_num=n + k) for k in range(10)]
    seen: list[int] = []

    async def probe() -> None:
        while True:
            seen.append(server.stats["kv_ops"])
            await asyncio.sleep(0)

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(server.endpoints["pull"])
    p = asyncio.create_task(probe())
    try:
        push.send(P.encode(P.BatchedKVOperationMsg(instance_id="inst-a", worker_id=0, location="L", operations=ops)))
        for _ in range(500):
            if server.stats["kv_ops"] == len(ops):
                break
            await asyncio.sleep(0.01)
        assert server.stats["kv_ops"] == len(ops) and server.stats["seq_gaps"] == 0
        assert sink.held()["inst-a"] == set(range(11, n + 1))
        assert {OPS_SLICE, 2 * OPS_SLICE, 3 * OPS_SLICE} <= set(seen)  # the loop ran between slices
    finally:
        p.cancel()
        await server.close()
        ctx.destroy(linger=0)
