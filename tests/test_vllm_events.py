"""vLLM KV event ingest against the frames recorded from a real vLLM 0.32 engine, over real ZMQ sockets."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from helpers import until
from vllm_helpers import FakeEngine, Recorder, engine_with_subscriber, free_port, running

from smetric_lmc.controller.vllm_events import VllmEventSubscriber, connectable, vllm_binds
from smetric_lmc.controller.vllm_plan import apply_batch
from smetric_lmc.controller.vllm_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DroppedEvent,
    PayloadError,
    decode_payload,
)


def _fixture() -> dict[str, Any]:
    shared = Path(os.environ.get("SMETRIC_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
    path = shared / "fixtures" / "vllm_kv_events.json"
    if not path.is_file():
        pytest.skip(f"recorded vLLM frames not found at {path} (set SMETRIC_SHARED)")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return _fixture()


@pytest.fixture(scope="module")
def frames(recorded: dict[str, Any]) -> list[tuple[int, bytes]]:
    return [(int(s, 16), bytes.fromhex(p)) for _, s, p in recorded["frames"]]


def expected_live(decoded: list[dict[str, Any]], seqs: Sequence[int] | None = None) -> set[int]:
    """Reference model computed from the fixture's own JSON decoding, independent of the module."""
    live: set[int] = set()
    for frame in decoded:
        if seqs is not None and frame["seq"] not in seqs:
            continue
        for ev in frame["events"]:
            if ev["type"] == "BlockStored":
                live.update(ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                live.difference_update(ev["block_hashes"])
            else:
                live.clear()
    return live


def restamp(payload: bytes, ts: float) -> bytes:
    msg = msgspec.msgpack.decode(payload)
    msg[0] = ts
    return msgspec.msgpack.encode(msg)


# ---------------------------------------------------------------------------- decoding


def test_decode_matches_recorded_decoding(recorded: dict[str, Any], frames: list[tuple[int, bytes]]) -> None:
    big = 0
    for (_, payload), ref in zip(frames, recorded["frames_decoded"], strict=True):
        batch = decode_payload(payload)
        assert batch.ts == ref["ts"] and batch.data_parallel_rank == ref["data_parallel_rank"]
        assert [type(e).__name__ for e in batch.events] == [e["type"] for e in ref["events"]]
        for ev, rev in zip(batch.events, ref["events"], strict=True):
            if isinstance(ev, BlockStored | BlockRemoved):
                assert ev.block_hashes == rev["block_hashes"]
                big += sum(h >= 1 << 63 for h in ev.block_hashes)
            if isinstance(ev, BlockStored):
                assert ev.parent_block_hash == rev["parent_block_hash"]
                assert ev.token_ids == rev["token_ids"] and ev.block_size == 32 and ev.medium == "GPU"
    assert big > 0, "the recording has hashes above 2^63; they must survive as unsigned ints"


def test_apply_recorded_totals(recorded: dict[str, Any], frames: list[tuple[int, bytes]]) -> None:
    sink, counts = Recorder(), {}
    applied = sum(apply_batch(decode_payload(p), sink, "e0", counts) for _, p in frames)
    assert counts["blocks_stored"] == 147 and counts["BlockStored"] == 16
    assert counts["BlockRemoved"] == counts["blocks_removed"] == 98
    assert counts["AllBlocksCleared"] == 1 and sink.n("cleared") == 1
    assert applied == 147 + 98
    assert sink.live["e0"] == expected_live(recorded["frames_decoded"])
    assert len(sink.live["e0"]) == 3
    # One sink call per run of consecutive removals, not one per evicted block.
    assert sink.n("removed") == 4


def test_unknown_malformed_and_legacy_events_do_not_sink_the_batch() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1, 5],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "medium": "GPU",
    }
    events = [
        stored,
        {"type": "BlockPinned", "block_hashes": [1]},
        {"type": "BlockRemoved", "block_hashes": [-3], "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [7], "token_ids": [1], "block_size": 2},
        {"type": "BlockRemoved", "block_hashes": [b"\x00" * 24 + (9).to_bytes(8, "big")]},
        ["BlockRemoved", [5], "GPU"],
        ["BlockStored", [11], 5, [8, 9], 2, None, "GPU"],
        {"type": "BlockStored", "block_hashes": [12], "token_ids": [1, 1], "block_size": 2, "medium": "CPU"},
        {"type": "BlockRemoved", "block_hashes": [11], "group_idx": 1},
        "nonsense",
    ]
    batch = decode_payload(msgspec.msgpack.encode([1.5, events, 0]))
    assert len(batch.events) == len(events)
    sink, counts = Recorder(), {}
    apply_batch(batch, sink, "e0", counts)
    assert sink.live["e0"] == {2**64 - 1, 11}
    assert counts["unknown"] == 1
    assert counts["malformed"] == 3  # negative hash, token/block mismatch, non-event
    assert counts["non_gpu"] == 1 and counts["other_group"] == 1
    # A digest-style hash folds to its last 8 bytes, as vLLM's int mode would have sent it.
    assert [e for e in batch.events if isinstance(e, BlockRemoved)][0].block_hashes == [9]


def test_array_form_batch_decodes_on_its_fast_path() -> None:
    payload = msgspec.msgpack.encode(
        [
            2.0,
            [
                ["BlockStored", [1, 2], None, [0] * 32, 16, None, "GPU"],
                ["BlockRemoved", [1]],
                ["AllBlocksCleared"],
            ],
            0,
        ]
    )
    batch = decode_payload(payload)
    kinds = (BlockStored, BlockRemoved, AllBlocksCleared)
    assert all(isinstance(e, k) for e, k in zip(batch.events, kinds, strict=True))
    assert not any(isinstance(e, DroppedEvent) for e in batch.events)
    sink = Recorder()
    assert apply_batch(batch, sink, "e0") == 3
    assert [c[0] for c in sink.calls] == ["stored", "removed", "cleared"]


@pytest.mark.parametrize(
    "payload", [b"", b"\xc1", b"\x93\x01", msgspec.msgpack.encode({"a": 1}), b"\x92\xa1x\x90"]
)
def test_garbage_payload_raises_payload_error(payload: bytes) -> None:
    with pytest.raises(PayloadError):
        decode_payload(payload)


def test_endpoint_roles_follow_vllms_rule() -> None:
    assert vllm_binds("tcp://*:5557") and vllm_binds("tcp://[::]:5557") and vllm_binds("ipc:///x")
    assert not vllm_binds("tcp://127.0.0.1:5557")
    assert connectable("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert connectable("tcp://[::]:5557") == "tcp://[::1]:5557"


# ---------------------------------------------------------------------------- sockets


@pytest.mark.parametrize("mode", ["ipc-derived-connect", "tcp-derived-bind", "tcp-explicit-connect"])
async def test_recorded_stream_end_to_end(
    mode: str,
    ctx: zmq.asyncio.Context,
    tmp_path: Path,
    recorded: dict[str, Any],
    frames: list[tuple[int, bytes]],
) -> None:
    sink = Recorder()
    if mode == "ipc-derived-connect":
        ep = f"ipc://{tmp_path}/kv.sock"
        engine = FakeEngine(ctx, ep, bind=True)
        sub = VllmEventSubscriber(ep, "e0", sink, replay_endpoint=engine.replay_endpoint, ctx=ctx)
        assert not sub.binds
    elif mode == "tcp-derived-bind":
        ep = f"tcp://127.0.0.1:{free_port()}"
        engine = FakeEngine(ctx, ep, bind=False)  # ZMQ connects retry until the peer binds
        sub = VllmEventSubscriber(ep, "e0", sink, replay_endpoint=engine.replay_endpoint, ctx=ctx)
        assert sub.binds
    else:
        engine, sub = engine_with_subscriber(ctx, sink)
    async with running(sub):
        await engine.subscribed()
        for seq, payload in frames:
            await engine.publish(seq, payload)
        await until(lambda: sub.stats.last_seq == 15)
    await engine.close()
    assert sink.live["e0"] == expected_live(recorded["frames_decoded"])
    st = sub.stats
    assert (st.batches, st.gaps, st.replays, st.unfilled_gaps, st.restarts) == (16, 0, 0, 0, 0)
    assert st.events["blocks_stored"] == 147 and st.events["BlockRemoved"] == 98
    assert st.events["AllBlocksCleared"] == 1
    assert st.last_event_time is not None and st.lag_s is not None


async def test_dropped_frames_are_replayed(
    ctx: zmq.asyncio.Context, recorded: dict[str, Any], frames: list[tuple[int, bytes]]
) -> None:
    sink = Recorder()
    engine, sub = engine_with_subscriber(ctx, sink)
    async with running(sub):
        await engine.subscribed()
        for seq, payload in frames:
            dropped = seq in (3, 4, 10, 15)
            await engine.publish(seq, payload, drop=dropped)
            if not dropped:
                await until(lambda s=seq: sub.stats.last_seq == s)
        # The last frame was dropped too: nothing reveals that gap until the next batch.
        assert sub.stats.last_seq == 14
        await engine.publish(16, msgspec.msgpack.encode([2e9, [], 0]))
        await until(lambda: sub.stats.last_seq == 16)
    await engine.close()
    assert engine.replay_requests == [3, 10, 15]
    assert sub.stats.gaps == 3 and sub.stats.replays == 3 and sub.stats.unfilled_gaps == 0
    assert sub.stats.duplicates == 3  # each live frame that revealed a gap came back in its replay
    assert sink.n("cleared") == 1
    assert sink.live["e0"] == expected_live(recorded["frames_decoded"])


async def test_recorded_replay_exchange_byte_for_byte(
    ctx: zmq.asyncio.Context, recorded: dict[str, Any], frames: list[tuple[int, bytes]]
) -> None:
    rec = recorded["replay"]
    canned = [[bytes.fromhex(f) for f in msg] for msg in rec["reply_messages_received_by_dealer_hex"]]
    sink = Recorder()
    engine, sub = engine_with_subscriber(ctx, sink, engine_kw={"canned_replay": canned})
    async with running(sub):
        await engine.subscribed()
        for seq, payload in frames:
            await engine.publish(seq, payload, drop=seq in (13, 14))
        await until(lambda: sub.stats.last_seq == 15)
    await engine.close()
    # The recorded exchange was a request from 13, exactly what this gap asks for.
    assert engine.raw_requests == [[bytes.fromhex(f) for f in rec["request_frames_sent_by_dealer_hex"]]]
    assert sub.stats.replays == 1 and sub.stats.unfilled_gaps == 0 and sub.stats.duplicates == 1
    assert sink.live["e0"] == expected_live(recorded["frames_decoded"])


async def test_late_subscriber_replays_from_zero(
    ctx: zmq.asyncio.Context, recorded: dict[str, Any], frames: list[tuple[int, bytes]]
) -> None:
    engine = FakeEngine(ctx, "tcp://127.0.0.1:*", bind=True)
    ep = engine.pub.getsockopt_string(zmq.LAST_ENDPOINT)
    for seq, payload in frames[:6]:
        await engine.publish(seq, payload)  # nobody is subscribed yet: lost on the PUB side
    sink = Recorder()
    sub = VllmEventSubscriber(ep, "e0", sink, replay_endpoint=engine.replay_endpoint, bind=False, ctx=ctx)
    async with running(sub):
        await engine.subscribed()
        for seq, payload in frames[6:]:
            await engine.publish(seq, payload)
        await until(lambda: sub.stats.last_seq == 15)
    await engine.close()
    assert engine.replay_requests == [0]
    assert sub.stats.unfilled_gaps == 0 and sub.stats.batches == 16
    assert sink.live["e0"] == expected_live(recorded["frames_decoded"])


async def test_unfillable_gap_marks_the_instance_stale_and_keeps_its_blocks(
    ctx: zmq.asyncio.Context, recorded: dict[str, Any], frames: list[tuple[int, bytes]]
) -> None:
    sink = Recorder()
    engine, sub = engine_with_subscriber(ctx, sink, {"replay": False}, replay_endpoint=None)
    async with running(sub):
        await engine.subscribed()
        for seq, payload in frames[:10]:
            await engine.publish(seq, payload, drop=seq == 8)
        await until(lambda: sub.stats.last_seq == 9)
    await engine.close()
    assert sub.stats.gaps == 1 and sub.stats.unfilled_gaps == 1 and sub.stats.replays == 0
    # Marked stale at the gap, never cleared: what batches 0..7 stored stays indexed, batch 9 adds on.
    assert sink.n("stale") == 1 and sink.n("cleared") == 0
    known = [s for s in range(10) if s != 8]
    assert sink.live["e0"] == expected_live(recorded["frames_decoded"], seqs=known)


async def test_replay_timeout_counts_and_marks_stale(
    ctx: zmq.asyncio.Context, frames: list[tuple[int, bytes]]
) -> None:
    sink = Recorder()
    engine, sub = engine_with_subscriber(ctx, sink, {"answer_replay": False}, replay_timeout_s=0.2)
    async with running(sub):
        await engine.subscribed()
        await engine.publish(0, frames[0][1])
        await engine.publish(1, frames[1][1], drop=True)
        await engine.publish(2, frames[2][1])
        await until(lambda: sub.stats.last_seq == 2)
    await engine.close()
    assert engine.replay_requests == [1]
    assert sub.stats.replay_failures == 1 and sub.stats.unfilled_gaps == 1
    assert sink.n("stale") == 1 and sink.n("cleared") == 0


async def test_engine_restart_clears_then_follows_the_new_engine(
    ctx: zmq.asyncio.Context, recorded: dict[str, Any], frames: list[tuple[int, bytes]]
) -> None:
    sink = Recorder()
    engine, sub = engine_with_subscriber(ctx, sink)
    async with running(sub):
        await engine.subscribed()
        for seq, payload in frames[:10]:
            await engine.publish(seq, payload)
        await until(lambda: sub.stats.last_seq == 9)
        before = set(sink.live["e0"])
        # A new engine process: seq restarts at 0, timestamps move on.
        engine.buffer.clear()
        later = decode_payload(frames[-1][1]).ts + 100.0
        for seq, payload in frames[:3]:
            await engine.publish(seq, restamp(payload, later + seq))
        await until(lambda: sub.stats.last_seq == 2 and sub.stats.batches == 13)
    await engine.close()
    assert sub.stats.restarts == 1 and sub.stats.replays == 0 and sub.stats.duplicates == 0
    assert sink.n("cleared") == 1
    after = expected_live(recorded["frames_decoded"], seqs=[0, 1, 2])
    assert sink.live["e0"] == after and after < before


async def test_garbage_frames_are_counted_and_ingest_continues(
    ctx: zmq.asyncio.Context, recorded: dict[str, Any], frames: list[tuple[int, bytes]]
) -> None:
    sink = Recorder()
    engine, sub = engine_with_subscriber(ctx, sink)
    unknown = msgspec.msgpack.encode([1.0, [{"type": "BlockPinned", "block_hashes": [1]}], 0])
    async with running(sub):
        await engine.subscribed()
        await engine.send_raw([b"kv"])
        await engine.send_raw([b"kv", b"\x00\x01", frames[0][1]])
        await engine.send_raw([b"kv", (0).to_bytes(8, "big"), b"\xc1garbage"])
        await engine.send_raw([b"kv", (0).to_bytes(8, "big"), b"\x93\xa1x\x90\x00"])
        await engine.send_raw([b"kv2", (0).to_bytes(8, "big"), frames[0][1]])
        await engine.send_raw([b"kv", (0).to_bytes(8, "big"), unknown])
        for seq, payload in frames:
            await engine.publish(seq + 1, payload)
        await until(lambda: sub.stats.last_seq == 16)
    await engine.close()
    st = sub.stats
    assert st.bad_frames == 2 and st.decode_errors == 2 and st.other_topic == 1
    assert st.events["unknown"] == 1 and st.gaps == 0 and st.restarts == 0
    assert sink.live["e0"] == expected_live(recorded["frames_decoded"])


async def test_garbage_replies_from_the_replay_endpoint(
    ctx: zmq.asyncio.Context, recorded: dict[str, Any], frames: list[tuple[int, bytes]]
) -> None:
    sink = Recorder()
    engine, sub = engine_with_subscriber(ctx, sink)
    engine.buffer.append((0, b"\xc1not msgpack"))  # served on replay only
    async with running(sub):
        await engine.subscribed()
        await engine.publish(1, frames[0][1])
        await until(lambda: sub.stats.last_seq == 1)
    await engine.close()
    assert engine.replay_requests == [0]
    assert sub.stats.decode_errors == 1 and sub.stats.unfilled_gaps == 1
    assert sink.live["e0"] == expected_live(recorded["frames_decoded"], seqs=[0])


async def test_ingest_yields_after_its_byte_budget(ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the byte budget can make the subscriber yield here; with a batch count alone, 40
    # queued ~100 KB frames were all handled in one turn of the loop (MB-sized hostile batches
    # held it ~100 ms in bench/soak.py's storm).
    from smetric_lmc.controller import vllm_events as V
    from smetric_lmc.controller.tasks import LoopBudget

    monkeypatch.setattr(V, "LOOP_BUDGET", LoopBudget(items=10**9, nbytes=300_000, seconds=3600.0))
    sink = Recorder()
    engine, sub = engine_with_subscriber(ctx, sink)
    seen: set[int] = set()

    async def probe() -> None:
        while True:
            seen.add(sub.stats.decode_errors)
            await asyncio.sleep(0)

    async with running(sub):
        await engine.subscribed()
        for seq in range(40):
            await engine.send_raw([b"kv", seq.to_bytes(8, "big"), b"\xc1" * 100_000])  # undecodable
        time.sleep(0.5)  # queued before the subscriber next runs (blocks the loop on purpose)
        p = asyncio.create_task(probe())
        await until(lambda: sub.stats.decode_errors == 40)
        p.cancel()
    await engine.close()
    assert any(0 < n < 40 for n in seen), seen


async def test_close_before_any_message_is_clean(ctx: zmq.asyncio.Context) -> None:
    sub = VllmEventSubscriber("tcp://127.0.0.1:*", "e0", Recorder(), bind=True, ctx=ctx)
    assert sub.endpoint.startswith("tcp://127.0.0.1:")
    async with running(sub):
        await asyncio.sleep(0.01)
    assert sub.stats.batches == 0


class FailingOnce(Recorder):
    """A sink whose first store raises, as an index bug would."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def gpu_stored(self, instance_id: str, *args: Any, **kw: Any) -> int:
        if not self.failed:
            self.failed = True
            raise RuntimeError("index bug")
        return super().gpu_stored(instance_id, *args, **kw)


async def test_sink_error_marks_stale_instead_of_clearing(
    ctx: zmq.asyncio.Context, frames: list[tuple[int, bytes]]
) -> None:
    sink = FailingOnce()
    engine, sub = engine_with_subscriber(ctx, sink)
    async with running(sub):
        await engine.subscribed()
        for seq, payload in frames[:4]:
            await engine.publish(seq, payload)
        await until(lambda: sub.stats.last_seq == 3)
    await engine.close()
    assert sub.stats.sink_errors == 1
    assert sink.n("stale") == 1 and sink.n("cleared") == 0 and sink.live["e0"]
