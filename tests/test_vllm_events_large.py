"""Large vLLM KV-event batches: planned in the frame worker process and applied in slices.

A legal batch (65,536 blocks, 1 M token ids: ~4.5 MB) costs ~50 ms to decode and ~60 ms to apply
here; on the event loop in one piece that would stall every client. These tests check that cutting
the work changes nothing in what the index ends up holding, and that the subscriber does cut it.
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq.asyncio
from helpers import until
from vllm_helpers import Recorder, engine_with_subscriber, running

from smetric_lmc.controller import vllm_events as V
from smetric_lmc.controller import vllm_plan as VP
from smetric_lmc.controller import vllm_wire as VW
from smetric_lmc.controller.offload import OffloadWorker
from smetric_lmc.controller.tasks import LoopBudget
from smetric_lmc.index import TierIndex

BS = 4
ENC = msgspec.msgpack.Encoder()


def stored(hashes: list[int], parent: int | None, rng: random.Random, **extra: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": [rng.randrange(1 << 17) for _ in range(len(hashes) * BS)], "block_size": BS,
            "medium": "GPU", **extra}


def removed(hashes: list[int]) -> list[dict[str, Any]]:
    return [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in hashes]


def batches(rng: random.Random) -> list[bytes]:
    """A prefix, a 2,500-block continuation under an adapter with multimodal keys, evictions, a
    run stored before its parent (kept aside, then adopted) and a plain long prompt."""
    prefix = [rng.getrandbits(64) for _ in range(3)]
    long = [rng.getrandbits(64) for _ in range(2500)]
    keys = [["img-a"] if i % 7 == 0 else None for i in range(2500)]
    early_parent = [rng.getrandbits(64) for _ in range(2)]
    early = [rng.getrandbits(64) for _ in range(900)]
    plain = [rng.getrandbits(64) for _ in range(1300)]
    return [ENC.encode([ts, events, 0]) for ts, events in (
        (1.0, [stored(prefix, None, rng)]),
        (2.0, [stored(long, prefix[-1], rng, lora_name="ad", extra_keys=keys)]),
        (3.0, [*removed(long[-1500:][::-1]), stored(early, early_parent[-1], rng)]),
        (4.0, [stored(early_parent, None, rng), stored(plain, None, rng), *removed(plain[-200:][::-1])]),
    )]


def held(index: TierIndex) -> list[tuple[int, int, int, bool]]:
    x = index.export_instance("e0")
    return sorted(zip(x["hash"].tolist(), x["parent"].tolist(), x["eng"].tolist(), x["stale"].tolist(), strict=True))


def fresh_index() -> TierIndex:
    index = TierIndex(BS)
    index.register_instance("e0")
    return index


def test_a_worker_plan_applied_in_slices_indexes_what_one_pass_does() -> None:
    payloads = batches(random.Random(7))
    whole, sliced = fresh_index(), fresh_index()
    whole_counts: dict[str, int] = {}
    sliced_counts: dict[str, int] = {}
    for payload in payloads:
        VP.apply_batch(VW.decode_payload(payload), whole, "e0", whole_counts)
        planned = VP.plan_payload(payload, 0, 65_536, 65_536, compact=True)
        assert isinstance(planned, VP.Planned)
        # What the worker sends back is numpy arrays, not lists of Python ints.
        assert all(isinstance(op[1], np.ndarray) for op in planned.ops if op[0] != VP.CLEARED)
        for op in planned.ops:
            for piece in VP.cut_op(op, 256):
                assert piece[0] == VP.CLEARED or (isinstance(piece[1], list) and len(piece[1]) <= 256)
                VP.run_op(piece, sliced, "e0")
        VP.add_counts(sliced_counts, planned.counts)
    assert whole_counts == sliced_counts and whole_counts["blocks_stored"] == 3 + 2500 + 900 + 2 + 1300
    assert held(whole) == held(sliced)
    assert len(held(whole)) == 3 + 1000 + 900 + 2 + 1100  # the early run was adopted once its parent came


def test_plan_payload_refuses_what_the_loop_refuses() -> None:
    rng = random.Random(1)
    ok = ENC.encode([1.0, [stored([1, 2], None, rng)] * 3, 0])
    assert VP.plan_payload(ok, 0, 2, None) == "oversize"
    assert VP.plan_payload(b"\xc1" * 300, 0, 10, None) == "decode"
    assert VP.plan_payload(b"\x91" * 100_000 + b"\xc0", 0, 10, None) == "decode"  # nesting: no RecursionError
    too_big = ENC.encode([1.0, [stored(list(range(10)), None, rng)], 0])
    planned = VP.plan_payload(too_big, 0, 10, 8)
    assert isinstance(planned, VP.Planned) and planned.ops == [] and planned.counts["malformed"] == 1


class IntsOnly(Recorder):
    """The Recorder, checking that the index is given plain ints (a numpy scalar would end up in
    its tables and snapshots), and noting when another task ran between two sink calls."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0
        self.interleaved = 0
        self._last_tick = 0

    def gpu_stored(self, instance_id: str, block_hashes: Any, parent: Any, token_ids: Any, block_size: int,
                   **kw: Any) -> int:
        assert type(block_hashes) is list and type(token_ids) is list
        assert all(type(h) is int for h in block_hashes) and (parent is None or type(parent) is int)
        self._note()
        return super().gpu_stored(instance_id, block_hashes, parent, token_ids, block_size)

    def gpu_removed(self, instance_id: str, block_hashes: Any) -> int:
        assert type(block_hashes) is list and all(type(h) is int for h in block_hashes)
        self._note()
        return super().gpu_removed(instance_id, block_hashes)

    def _note(self) -> None:
        if self.ticks != self._last_tick:
            self.interleaved += 1
        self._last_tick = self.ticks


def big_batch(rng: random.Random, n: int) -> tuple[bytes, set[int]]:
    hashes = [rng.getrandbits(64) for _ in range(n)]
    payload = ENC.encode([1.0, [stored(hashes, None, rng), *removed(hashes[-n // 4:])], 0])
    return payload, set(hashes[: n - n // 4])


async def test_large_batches_go_to_the_worker_and_are_applied_in_slices(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    monkeypatch.setattr(V, "SLICE_BLOCKS", 128)
    # A loop turn after every slice (and every received batch).
    monkeypatch.setattr(V, "SLICE_BUDGET", LoopBudget(items=1 << 62, nbytes=1 << 62, seconds=0.0))
    monkeypatch.setattr(V, "LOOP_BUDGET", LoopBudget(seconds=0.0))
    rng = random.Random(3)
    payload, expected = big_batch(rng, 2000)
    small = ENC.encode([2.0, [stored([rng.getrandbits(64)], None, rng)], 0])
    sink = IntsOnly()
    worker = OffloadWorker()  # a real spawned process, as the controller runs it
    try:
        engine, sub = engine_with_subscriber(ctx, sink, worker=worker, offload_bytes=len(payload) - 1)

        async def tick() -> None:
            while True:
                sink.ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        async with running(sub):
            await engine.subscribed()
            await engine.publish(0, payload)
            await engine.publish(1, small)
            await until(lambda: sub.stats.last_seq == 1, timeout=60)
        ticker.cancel()
        await engine.close()
    finally:
        worker.close()
    assert sub.stats.offloaded == 1 and sub.stats.large_on_loop == 0 and sub.stats.worker_failures == 0
    assert sink.live["e0"] == expected | set(msgspec.msgpack.decode(small)[1][0]["block_hashes"])
    assert sub.stats.events["blocks_stored"] == 2001 and sub.stats.events["blocks_removed"] == 500
    # 2000 stored + 500 removed blocks in slices of 128: 20 sink calls, the loop ran between them.
    assert sink.n("stored") == 16 + 1 and sink.n("removed") == 4
    assert sink.interleaved >= 15


class CrashingWorker(OffloadWorker):
    """Stands in for a worker process that dies while it holds a frame (what a real crash makes
    ``submit``'s future raise); the first frame only."""

    def __init__(self) -> None:
        super().__init__()
        self.crashed = False

    def start(self) -> bool:
        return True

    def submit(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.crashed:
            fut.set_result(fn(*args))
        else:
            self.crashed = True
            fut.set_exception(BrokenProcessPool("worker died"))
        return fut


async def test_a_batch_lost_with_the_worker_is_replayed(ctx: zmq.asyncio.Context) -> None:  # noqa: F811
    rng = random.Random(5)
    first, expected_first = big_batch(rng, 300)
    second, expected_second = big_batch(rng, 300)
    sink = Recorder()
    engine, sub = engine_with_subscriber(ctx, sink, worker=CrashingWorker(), offload_bytes=1000)
    async with running(sub):
        await engine.subscribed()
        await engine.publish(0, first)
        await engine.publish(1, ENC.encode([2.0, [], 0]))  # small: on the loop; shows the gap
        await engine.publish(2, second)
        await until(lambda: sub.stats.last_seq == 2)
    await engine.close()
    assert sub.stats.worker_failures == 1 and sub.stats.offloaded >= 2  # the replay may bring batch 2 too
    assert engine.replay_requests == [0] and sub.stats.unfilled_gaps == 0
    assert sink.live["e0"] == expected_first | expected_second


async def test_without_a_worker_large_batches_are_counted_on_the_loop(ctx: zmq.asyncio.Context) -> None:  # noqa: F811
    rng = random.Random(6)
    payload, expected = big_batch(rng, 300)
    sink = Recorder()
    engine, sub = engine_with_subscriber(ctx, sink, offload_bytes=1000)
    async with running(sub):
        await engine.subscribed()
        await engine.publish(0, payload)
        await until(lambda: sub.stats.last_seq == 0)
    await engine.close()
    assert sub.stats.large_on_loop == 1 and sub.stats.offloaded == 0
    assert sink.live["e0"] == expected
