"""Large LMCache PULL messages: decoded in the frame worker process, applied a slice at a time.

A 16 MiB frame (the default limit) holds ~1.8 M full-sync keys or ~450 k KV operations; decoding it
on the event loop costs ~60 ms and applying it at once far more. These tests check that the bulk
list applied from the worker's numpy columns, in slices, gives the index what one pass gives.
"""

from __future__ import annotations

import asyncio
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np
import pytest
import zmq.asyncio
from lmcache_helpers import RecordingSink, ops, push, reg, serving, until

from smetric_lmc.controller import lmcache_kvops as kvops
from smetric_lmc.controller import lmcache_proto as P
from smetric_lmc.controller import offload
from smetric_lmc.controller.offload import OffloadWorker


def test_split_bulk_columns_keep_every_operation() -> None:
    pairs = [("admit", -(1 << 63)), ("evict", (1 << 63) - 1), ("admit", 5)]
    msg = P.decode(ops("a", pairs, seq0=7))
    stub, bulk = P.split_bulk(msg, compact=True)
    assert isinstance(stub, P.BatchedKVOperationMsg) and stub.operations == [] and stub.worker_id == 0
    assert bulk is not None and all(isinstance(c, np.ndarray) for c in bulk)
    assert list(zip(bulk.admits.tolist(), bulk.keys.tolist(), bulk.seqs.tolist(), strict=True)) == [
        (True, -(1 << 63), 7), (False, (1 << 63) - 1, 8), (True, 5, 9)]
    # Keys that fit neither int64 nor uint64 together stay a list.
    _, mixed = P.split_bulk(P.decode(ops("a", [("admit", -1), ("admit", (1 << 64) - 1)])), compact=True)
    assert mixed is not None and mixed.keys == [-1, (1 << 64) - 1]
    sync = P.FullSyncBatchMsg(instance_id="a", worker_id=0, location="L", sync_id="s", batch_id=0, keys=[3, 1 << 63])
    stub, bulk = P.split_bulk(P.decode(P.encode(sync)), compact=True)
    assert isinstance(stub, P.FullSyncBatchMsg) and stub.keys == [] and bulk is not None
    assert bulk.admits is None and bulk.keys.dtype == np.uint64 and bulk.keys.tolist() == [3, 1 << 63]
    assert "malformed" in P.decode_split(b"\xc1" * 10)


class TickingSink(RecordingSink):
    """Notes how many sink calls had another task run since the call before."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks = self._last = self.interleaved = 0

    def lmcache_admit(self, instance_id: str, chunk_hashes: Any) -> None:
        assert all(type(h) is int for h in chunk_hashes)  # no numpy scalars into the index
        self.interleaved += self.ticks != self._last
        self._last = self.ticks
        super().lmcache_admit(instance_id, chunk_hashes)


async def test_large_pull_frames_go_to_the_worker_and_apply_in_slices(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    monkeypatch.setattr(offload, "OFFLOAD_BYTES", 1000)
    monkeypatch.setattr(kvops, "OPS_SLICE", 500)
    sink = TickingSink()
    worker = OffloadWorker()  # a real spawned process, as the controller runs it
    n = 6000
    admits = [("admit", k) for k in range(n)]
    evicts = [("evict", k) for k in range(0, n, 2)]
    keys = list(range(10**6, 10**6 + n))

    async def tick() -> None:
        while True:
            sink.ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    try:
        async with serving(ctx, sink, heartbeat_url=None, full_sync_on_start=False, worker=worker) as (server, w):
            await w.call(reg("a"))
            await push(server, w, [ops("a", admits + evicts)])
            await until(lambda: server.stats["kv_ops"] == n + n // 2, timeout=60)
            assert sink.held()["a"] == set(range(1, n, 2))
            # A full sync whose one batch carries every key.
            start = P.FullSyncStartMsg(instance_id="a", worker_id=0, location="LocalCPUBackend", sync_id="s",
                                       total_keys=n, batch_count=1)
            assert (await w.call(start)).accepted
            await push(server, w, [P.encode(P.FullSyncBatchMsg(instance_id="a", worker_id=0,
                                                               location="LocalCPUBackend", sync_id="s",
                                                               batch_id=0, keys=keys))])
            await until(lambda: sink.held()["a"] == set(keys), timeout=60)
            await push(server, w, [b"\xc1" * 5000])  # undecodable: refused in the worker
            await until(lambda: server.stats["decode_errors"] == 1, timeout=60)
            assert server.stats["offloaded"] == 3 and server.stats["large_on_loop"] == 0
            assert server.stats["worker_failures"] == 0
    finally:
        ticker.cancel()
        worker.close()
    # Operations and keys both arrived in slices of 500, with the loop running between them.
    admit_calls = [c for c in sink.calls if c[0] == "admit"]
    evict_calls = [c for c in sink.calls if c[0] == "evict"]
    # 9,000 operations: 12 slices of admits, 6 of evictions; then 12 slices of full-sync keys.
    assert len(admit_calls) == 12 + 12 and len(evict_calls) == 6
    assert max(len(c[2]) for c in admit_calls + evict_calls) <= 500
    assert sink.interleaved >= len(admit_calls) - 2


class CrashingWorker(OffloadWorker):
    """Stands in for a worker process that dies holding the frame (what a real crash makes the
    future raise); no process is started."""

    def start(self) -> bool:
        return True

    def submit(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_exception(BrokenProcessPool("worker died"))
        return fut


async def test_a_frame_lost_with_the_worker_is_counted_and_the_server_goes_on(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    monkeypatch.setattr(offload, "OFFLOAD_BYTES", 1000)
    sink = RecordingSink()
    async with serving(ctx, sink, full_sync_on_start=False, worker=CrashingWorker()) as (server, w):
        await w.call(reg("a"))
        await push(server, w, [ops("a", [("admit", k) for k in range(500)])])
        await push(server, w, [ops("a", [("admit", 7)], seq0=500)])  # small: decoded on the loop
    assert server.stats["worker_failures"] == 1 and server.stats["internal_errors"] == 0
    assert sink.held()["a"] == {7}


async def test_without_a_worker_large_frames_are_counted_on_the_loop(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    monkeypatch.setattr(offload, "OFFLOAD_BYTES", 1000)
    sink = RecordingSink()
    async with serving(ctx, sink, full_sync_on_start=False) as (server, w):
        await w.call(reg("a"))
        await push(server, w, [ops("a", [("admit", k) for k in range(500)])])
        await until(lambda: len(sink.held().get("a", ())) == 500)
    assert server.stats["large_on_loop"] == 1 and server.stats["offloaded"] == 0
