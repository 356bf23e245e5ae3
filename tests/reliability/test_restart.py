"""Controller restart loses nothing: snapshot, reload, replay from the snapshot's sequence numbers.

The engine is ``RecordedEngine`` (tests/test_controller_app.py): real vLLM 0.32 KV-event frames
from the fixture on a real XPUB, and a ROUTER answering replays from the same recording.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import zmq.asyncio
from app_helpers import RecordedEngine, base_config  # noqa: E402
from helpers import wait_for
from kit.index_content import same_content
from services import fixture_path

from smetric_lmc.client import AsyncRouteClient
from smetric_lmc.config import parse_config
from smetric_lmc.controller.app import ControllerApp
from smetric_lmc.controller.vllm_plan import apply_batch
from smetric_lmc.controller.vllm_wire import decode_payload
from smetric_lmc.index import TierIndex
from smetric_lmc.index import snapshot as S


def _config(engine: RecordedEngine, path: Path) -> dict:
    return base_config(
        instances=[{"id": "a", "http": "http://127.0.0.1:9", "kv_events": f"tcp://127.0.0.1:{engine.pub_port}",
                    "replay": f"tcp://127.0.0.1:{engine.replay_port}"}],
        snapshot={"path": str(path), "interval_s": 3600},
    )


def _truth(frames: list[list[bytes]], upto: int) -> TierIndex:
    """What an index holds after every batch 0..upto, applied straight from the recording."""
    idx = TierIndex(32)
    idx.register_instance("a")
    for _topic, _seq, payload in frames[: upto + 1]:
        apply_batch(decode_payload(payload), idx, "a")
    return idx


async def test_restart_reloads_the_snapshot_and_replays_what_it_missed(tmp_path: Path) -> None:
    fixture = json.loads(fixture_path("vllm_kv_events.json").read_text())
    ctx = zmq.asyncio.Context()
    engine = RecordedEngine(fixture["frames"], ctx)
    path = tmp_path / "index.snap"
    last = len(engine.frames) - 1
    try:
        first = ControllerApp(parse_config(_config(engine, path)), enable_metrics_http=False)
        await first.start()
        await engine.wait_subscribed()
        for seq in range(6):
            await engine.publish(seq)
        await wait_for(lambda: first.subscribers["a"].stats.last_seq == 5, what="batch 5 applied")
        await first.close()  # a clean stop writes the snapshot
        assert S.read(path) is not None and S.read(path).instances["a"].seq == 5  # type: ignore[union-attr]
        assert same_content(first.index, _truth(engine.frames, 5), ["a"]) == []

        for seq in range(6, last + 1):  # the engine goes on while no controller listens
            await engine.publish(seq)
        second = ControllerApp(parse_config(_config(engine, path)), enable_metrics_http=False)
        await second.start()
        try:
            assert second.core.catching_up  # restoring in the background: routes go by load
            sub = second.subscribers["a"]
            await wait_for(lambda: sub.caught_up.is_set() and not second.core.catching_up, what="catch-up")
            assert second.snapshots.stats["restored_blocks"] > 0
            assert engine.replay_requests == [6]  # from the batch after the snapshot's, not from 0
            assert sub.stats.last_seq == last and sub.stats.gaps == 0
            assert same_content(second.index, _truth(engine.frames, last), ["a"]) == []
            async with AsyncRouteClient(second.service.endpoint or "", timeout_s=3.0) as client:
                d = await client.route("r1", token_ids=[1] * 64, turn=0)
                assert d.index_ready is True and d.instance_id == "a"
        finally:
            await second.close()
    finally:
        await engine.close()
        ctx.destroy(linger=0)


async def test_routes_by_load_until_the_replay_is_in(tmp_path: Path) -> None:
    fixture = json.loads(fixture_path("vllm_kv_events.json").read_text())
    ctx = zmq.asyncio.Context()
    engine = RecordedEngine(fixture["frames"], ctx)
    path = tmp_path / "index.snap"
    try:
        idx = _truth(engine.frames, 3)
        S.write(path, S.take(idx, {"a": (3, None)}))
        engine.replay.close(linger=0)  # the replay never answers: catch-up waits for its deadline
        cfg = _config(engine, path)
        # Long enough that the first route below is answered before the deadline even on a loaded
        # machine (start + connect took over 0.5 s once).
        cfg["limits"] = {"replay_frame_timeout_s": 2.0, "replay_deadline_s": 2.0}
        app = ControllerApp(parse_config(cfg), enable_metrics_http=False)
        await app.start()
        try:
            async with AsyncRouteClient(app.service.endpoint or "", timeout_s=3.0) as client:
                d = await client.route("r1", token_ids=[1] * 64, turn=0)
                assert d.index_ready is False and d.policy == "load_balance"
                await wait_for(lambda: not app.core.catching_up, 10.0, "catch-up deadline")
                # What replay could not confirm is kept, marked stale.
                assert app.index.stale_instances() == ["a"] and app.index.gpu_blocks_of("a") > 0
                d = await client.route("r2", token_ids=[1] * 64, turn=0)
                assert d.index_ready is True
        finally:
            await app.close()
    finally:
        await engine.close()
        ctx.destroy(linger=0)


async def test_a_closed_replay_peer_receives_nothing(ctx: zmq.asyncio.Context) -> None:
    # Closed before its task first ran, as above: had the task gone on to receive, it would read
    # through the freed socket and take the first route request from the controller's ROUTER.
    engine = RecordedEngine([], ctx)
    engine.replay.close(linger=0)
    await asyncio.sleep(0)
    assert engine._task.done() and engine._task.exception() is None
    await engine.close()


async def test_routes_are_answered_while_a_large_snapshot_is_restored(tmp_path: Path) -> None:
    idx = TierIndex(32)
    for i in range(2):
        idx.register_instance(f"i{i}")
    rng = random.Random(3)
    for k in range(4000):  # 200,000 blocks: about a second to restore here
        chain = [rng.getrandbits(63) + 1 for _ in range(50)]
        idx.gpu_stored_hashes(f"i{k % 2}", chain, engine_hashes=[rng.getrandbits(63) + 1 for _ in chain])
    path = tmp_path / "index.snap"
    S.write(path, S.take(idx))
    cfg = base_config(instances=[{"id": "i0", "http": "http://127.0.0.1:9"}, {"id": "i1", "http": "http://127.0.0.1:9"}],
                      snapshot={"path": str(path)})
    app = ControllerApp(parse_config(cfg), enable_metrics_http=False)
    t0 = time.monotonic()
    await app.start()
    try:
        async with AsyncRouteClient(app.service.endpoint or "", timeout_s=3.0) as client:
            d = await client.route("r1", token_ids=[1] * 64, turn=0)
            answered = time.monotonic() - t0
            assert app.core.catching_up and d.index_ready is False and d.instance_id in ("i0", "i1")
            await wait_for(lambda: not app.core.catching_up, 30.0, "restore")
            assert answered < app.snapshots.stats["restore_s"]
            assert same_content(app.index, idx) == []
    finally:
        await app.close()
