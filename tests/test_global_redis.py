"""RedisGlobalTier: recorded notifications replayed through the mapper, then a real redis-server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable

import pytest
import redis
from helpers import RecorderSink, wait_for
from services import RedisServer, fixture_path, free_port, require_redis

from smetric_lmc.controller.global_redis import (
    RedisGlobalTier,
    apply_keyevent,
    keyevent_action,
    merged_notify_flags,
    scan_pattern,
)
from smetric_lmc.controller.lmcache_keys import REDIS_SUFFIXES, ChunkPresence, format_key

MODEL = "tiny/qwen2"


def chunk_key(h: int, suffix: str, model: str = MODEL) -> str:
    return format_key(model, 1, 0, h, "bfloat16", suffix=suffix)


def write_chunk(r: redis.Redis, h: int, kv_size: int = 64) -> None:
    # Same order as LMCache's RedisConnector.put: KV bytes first, then metadata.
    r.set(chunk_key(h, "kv_bytes"), b"\0" * kv_size)
    r.set(chunk_key(h, "metadata"), b"\1" * 28)


def live_chunks(r: redis.Redis) -> set[int]:
    return ChunkPresence(MODEL, suffixes=REDIS_SUFFIXES).reset(r.scan_iter(match=f"{MODEL}@*"))


# ---- pure mapping on the recorded fixture ----------------------------------------------------------


def test_fixture_replay_matches_remaining_keys() -> None:
    data = json.loads(fixture_path("redis_keyspace_events.json").read_text())
    presence = ChunkPresence(MODEL, suffixes=REDIS_SUFFIXES)
    sink = RecorderSink()
    for n in data["notifications"]:
        change = apply_keyevent(presence, n["channel"], n["data"].encode())
        if change is not None:
            kind, chunk = change
            getattr(sink, f"global_{kind}")([chunk])
    remaining = data["after_run"]["remaining_keys"]
    expected = ChunkPresence(MODEL, suffixes=REDIS_SUFFIXES).reset(remaining)
    assert presence.present() == expected == sink.chunks
    assert sorted(presence.keys()) == sorted(remaining)
    # Evicting one half of a pair leaves an orphan key but no usable chunk.
    orphans = [k for k in remaining if not any(k.startswith(f"{MODEL}@1@0@{h:x}@") for h in expected)]
    assert orphans, "fixture should contain half-evicted chunks"
    assert len(expected) < 24 and presence.stats()["bad_keys"] == 0


def test_keyevent_action_mapping() -> None:
    assert keyevent_action("__keyevent@0__:set") == "add"
    assert keyevent_action(b"__keyevent@3__:evicted") == "remove"
    assert keyevent_action("__keyevent@0__:expired") == "remove"
    assert keyevent_action("__keyevent@0__:del") == "remove"
    assert keyevent_action("__keyevent@0__:expire") is None  # TTL set: key still exists
    assert keyevent_action("__keyspace@0__:k") is None
    assert keyevent_action(b"\xff") is None
    assert keyevent_action(42) is None  # type: ignore[arg-type]


def test_notify_flags_and_scan_pattern() -> None:
    assert merged_notify_flags("") == "Eg$xe"
    assert merged_notify_flags("KEA") == "KEA"
    assert set(merged_notify_flags("Kx")) == set("KxEg$e")
    assert scan_pattern("org/m[1]*?") == r"org/m\[1\]\*\?@*"


def test_bad_pubsub_messages_are_counted_not_raised() -> None:
    sink = RecorderSink()
    tier = RedisGlobalTier("redis://127.0.0.1:1/0", sink, model=MODEL)
    tier._apply_messages([
        None, "junk", {"type": "pmessage"}, {"type": "pmessage", "channel": 5, "data": None},
        {"type": "pmessage", "channel": b"__keyevent@0__:set", "data": b"\xff\xfe"},
        {"type": "pmessage", "channel": b"__keyevent@0__:set", "data": chunk_key(7, "kv_bytes").encode()},
        {"type": "pmessage", "channel": b"__keyevent@0__:set", "data": chunk_key(7, "metadata").encode()},
    ])
    assert sink.chunks == {7}
    assert tier.stats["bad_messages"] == 2 and tier.stats["bad_keys"] == 1


# ---- real redis-server -------------------------------------------------------------------------------


@pytest.fixture
def redis_server() -> Iterable[RedisServer]:
    with RedisServer() as srv:
        yield srv


async def start_tier(url: str, sink: RecorderSink, **kw: object) -> tuple[RedisGlobalTier, asyncio.Task[None]]:
    tier = RedisGlobalTier(url, sink, model=MODEL, backoff_initial_s=0.05, backoff_max_s=0.2, **kw)
    return tier, asyncio.create_task(tier.run())


@pytest.mark.services
async def test_real_redis_set_del_and_initial_scan(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    write_chunk(r, -1)
    r.set(chunk_key(-2, "kv_bytes"), b"x")  # half-written chunk: not present
    sink = RecorderSink()
    tier, task = await start_tier(redis_server.url, sink, reconcile_interval_s=60.0)
    try:
        await wait_for(lambda: tier.available, what="connect")
        assert sink.calls[0] == ("reset", [-1])
        assert r.config_get("notify-keyspace-events")["notify-keyspace-events"] != ""
        r.set(chunk_key(-2, "metadata"), b"m")
        write_chunk(r, 0x7FFF)
        write_chunk(r, 5, kv_size=8)
        for h in (11, 12):  # another model's chunks are ignored
            r.set(format_key("other/model", 1, 0, h, "bfloat16", suffix="kv_bytes"), b"x")
            r.set(format_key("other/model", 1, 0, h, "bfloat16", suffix="metadata"), b"x")
        await wait_for(lambda: sink.chunks == {-1, -2, 0x7FFF, 5}, what="stored")
        r.delete(chunk_key(5, "kv_bytes"))  # either half going removes the chunk
        r.delete(chunk_key(-1, "metadata"))
        r.set(chunk_key(0x7FFF, "kv_bytes"), b"y")  # overwrite: no change
        await wait_for(lambda: sink.chunks == {-2, 0x7FFF}, what="removed")
        stored = [h for kind, hs in sink.calls if kind == "stored" for h in hs]
        assert stored == [-2, 0x7FFF, 5]
        assert tier.stats["foreign_keys"] == 4 and tier.stats["removed"] == 2
    finally:
        await tier.close()
    assert task.done() and task.exception() is None
    assert not tier.available


@pytest.mark.services
async def test_real_redis_eviction_matches_server(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    r.config_set("maxmemory", "3mb")
    r.config_set("maxmemory-policy", "allkeys-lru")
    sink = RecorderSink()
    tier, task = await start_tier(redis_server.url, sink, reconcile_interval_s=60.0)
    try:
        await wait_for(lambda: tier.available, what="connect")
        for h in range(-20, 20):
            write_chunk(r, h * 7919, kv_size=128 * 1024)
        assert int(r.info("stats")["evicted_keys"]) > 0
        expected = live_chunks(r)
        assert 0 < len(expected) < 40
        await wait_for(lambda: sink.chunks == expected, what="eviction events applied")
        assert tier.stats["reconciles"] == 1  # events alone got it right
    finally:
        await tier.close()


@pytest.mark.services
async def test_real_redis_flushall_needs_reconcile(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    sink = RecorderSink()
    tier, task = await start_tier(redis_server.url, sink, reconcile_interval_s=0.3)
    try:
        await wait_for(lambda: tier.available, what="connect")
        for h in (1, 2, 3):
            write_chunk(r, h)
        await wait_for(lambda: sink.chunks == {1, 2, 3}, what="stored")
        n_removed = tier.stats["removed"]
        r.flushall()
        await wait_for(lambda: sink.chunks == set(), what="reconciled flush")
        assert tier.stats["removed"] == n_removed  # FLUSHALL emitted no per-key event
        assert sink.calls[-1] == ("reset", [])
        write_chunk(r, 4)
        tier.request_reconcile()
        await wait_for(lambda: sink.chunks == {4}, what="write after flush")
    finally:
        await tier.close()


@pytest.mark.services
async def test_real_redis_restart_recovers(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    write_chunk(r, 1)
    sink = RecorderSink()
    tier, task = await start_tier(redis_server.url, sink, reconcile_interval_s=60.0)
    try:
        await wait_for(lambda: sink.chunks == {1} and tier.available, what="connect")
        redis_server.stop()
        await wait_for(lambda: not tier.available, what="outage noticed")
        assert sink.chunks == set()  # routing falls back to local tiers only
        await asyncio.sleep(0.3)  # several failed reconnects while down
        assert tier.stats["connection_errors"] >= 2 and not task.done()
        redis_server.start()
        r = redis.Redis.from_url(redis_server.url)
        write_chunk(r, 2)
        await wait_for(lambda: tier.available and sink.chunks == {2}, what="recovery")
        write_chunk(r, 3)
        await wait_for(lambda: sink.chunks == {2, 3}, what="events after recovery")
        assert tier.stats["connects"] == 2
    finally:
        await tier.close()


@pytest.mark.services
async def test_config_refused_is_tolerated() -> None:
    # Managed Redis services disable CONFIG; notifications are preconfigured there.
    with RedisServer("--rename-command", "CONFIG", "", "--notify-keyspace-events", "KEA") as srv:
        r = redis.Redis.from_url(srv.url)
        sink = RecorderSink()
        tier, task = await start_tier(srv.url, sink, reconcile_interval_s=60.0)
        try:
            await wait_for(lambda: tier.available, what="connect")
            write_chunk(r, 9)
            await wait_for(lambda: sink.chunks == {9}, what="stored")
            assert tier.stats["config_refused"] == 1
        finally:
            await tier.close()


async def test_unreachable_redis_never_raises() -> None:
    require_redis()
    sink = RecorderSink()
    tier, task = await start_tier(f"redis://127.0.0.1:{free_port()}/0", sink, reconcile_interval_s=1.0)
    await wait_for(lambda: tier.stats["connection_errors"] >= 3, what="retries")
    assert not tier.available and not task.done() and sink.calls == []
    await tier.close()
    assert task.done() and task.exception() is None
