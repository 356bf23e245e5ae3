import json

import pytest
from services import fixture_path

from smetric_lmc.controller.lmcache_keys import (
    BARE_SUFFIXES,
    REDIS_SUFFIXES,
    ChunkPresence,
    LMCacheKey,
    format_key,
    key_to_string,
    parse_key,
)


def test_fixture_keys_round_trip_with_recorded_hashes() -> None:
    data = json.loads(fixture_path("lmcache_chunk_hashes.json").read_text())
    params = data["cache_engine_key_params"]
    checked = 0
    for case in data["cases"].values():
        for result in case["results"].values():
            for h, key in zip(result["chunk_hashes"], result["all_chunk_keys"], strict=True):
                assert format_key(params["model_name"], params["world_size"], params["worker_id"], h,
                                  params["dtype"]) == key
                parsed = parse_key(key)
                assert parsed == LMCacheKey("tiny/qwen2", 1, 0, h, "bfloat16")
                assert key_to_string(parsed) == key
                checked += 1
    assert checked > 10


def test_negative_hash_and_redis_suffixes() -> None:
    key = "tiny/qwen2@1@0@-3db58dd109e8e520@bfloat16"
    assert parse_key(key).chunk_hash == -0x3DB58DD109E8E520
    kv = parse_key(key + "kv_bytes", REDIS_SUFFIXES)
    meta = parse_key((key + "metadata").encode(), REDIS_SUFFIXES)
    assert kv.suffix == "kv_bytes" and meta.suffix == "metadata"
    assert kv.chunk_hash == meta.chunk_hash == -0x3DB58DD109E8E520
    # Each layout accepts only its own key shapes.
    assert parse_key(key, REDIS_SUFFIXES) is None
    assert parse_key(key + "kv_bytes", BARE_SUFFIXES) is None


def test_layer_and_tag_forms() -> None:
    k = parse_key("m@2@1@ff@half@3@user%alice@lvl%a%b")
    assert k == LMCacheKey("m", 2, 1, 255, "half", 3, (("user", "alice"), ("lvl", "a%b")))
    assert key_to_string(k) == "m@2@1@ff@half@3@user%alice@lvl%a%b"
    assert parse_key("m@1@0@ff@half@user%x").layer_id is None


@pytest.mark.parametrize(
    "bad",
    [
        "", "garbage", "m@1@0@ff", "m@1@0@zz@bfloat16", "m@1@0@0x1f@bfloat16", "m@1@0@ 1f@bfloat16",
        "m@1@0@1_f@bfloat16", "m@1@0@-0@bfloat16", "m@1@0@00ff@bfloat16", "m@1@0@FF@bfloat16",
        "m@1@1@ff@bfloat16", "m@0@0@ff@bfloat16", "m@x@0@ff@bfloat16", "m@1@-1@ff@bfloat16",
        "m@1@0@ff@float128", "@1@0@ff@bfloat16", "m@1@0@ff@bfloat16@notatag", b"\xff\xfe@1@0@1@half",
    ],
)
def test_bad_keys_give_none(bad: str | bytes) -> None:
    assert parse_key(bad) is None


def test_presence_requires_every_shard_and_suffix() -> None:
    p = ChunkPresence("m", world_size=2, suffixes=REDIS_SUFFIXES)
    keys = [format_key("m", 2, w, -5, "bfloat16", suffix=s) for w in (0, 1) for s in REDIS_SUFFIXES]
    assert [p.add(k) for k in keys] == [None, None, None, -5]
    assert -5 in p and len(p) == 1
    assert p.add(keys[0]) is None  # duplicate write changes nothing
    assert p.remove(keys[2]) == -5  # losing one half of one shard loses the chunk
    assert p.remove(keys[2]) is None
    assert p.remove(keys[1]) is None
    assert p.add(keys[1]) is None
    assert p.add(keys[2]) == -5
    assert sorted(p.keys()) == sorted(keys)


def test_presence_filters_model_world_size_and_counts_bad() -> None:
    p = ChunkPresence("m", world_size=1)
    assert p.add("other@1@0@1@half") is None
    assert p.add("m@2@0@1@half") is None
    assert p.add("m@1@0@1@half@0") is None  # layerwise key while not in layer mode
    assert p.add("not a key") is None
    assert p.remove(b"\x00\x01") is None
    assert p.stats() == {"chunks_present": 0, "partial_entries": 0, "bad_keys": 2, "foreign_keys": 3}


def test_presence_layer_mode_and_variants() -> None:
    p = ChunkPresence("m", world_size=1, num_layers=2)
    assert p.add("m@1@0@a@half@0") is None
    assert p.add("m@1@0@a@half@2") is None  # layer out of range: foreign
    assert p.add("m@1@0@a@half@1") == 10
    # A second complete dtype variant keeps the chunk present when the first goes.
    q = ChunkPresence("m")
    assert q.add("m@1@0@a@half") == 10
    assert q.add("m@1@0@a@bfloat16") is None
    assert q.remove("m@1@0@a@half") is None
    assert 10 in q
    assert q.remove("m@1@0@a@bfloat16") == 10


def test_presence_reset_and_keys_round_trip() -> None:
    p = ChunkPresence("m", world_size=2, suffixes=REDIS_SUFFIXES)
    keys = [format_key("m", 2, w, h, "half", suffix=s) for h in (1, -2, 2**63 - 1, -(2**63))
            for w in (0, 1) for s in REDIS_SUFFIXES]
    keys.remove(format_key("m", 2, 1, 1, "half", suffix="metadata"))
    assert p.reset(keys + ["junk"]) == {-2, 2**63 - 1, -(2**63)}
    assert sorted(p.keys()) == sorted(keys)
    assert p.reset([]) == set() and list(p.keys()) == []


def test_presence_rejects_bad_config() -> None:
    with pytest.raises(ValueError):
        ChunkPresence("m", world_size=0)
    with pytest.raises(ValueError):
        ChunkPresence("m", suffixes=())
