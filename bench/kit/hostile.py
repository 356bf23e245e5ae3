"""Malformed messages for the controller's peer-facing sockets.

Used by the reliability suite (``tests/reliability``) and ``bench/soak.py``: each generator
returns one message (its ZMQ frames) of a named kind, drawn from a seeded ``random.Random`` so
that a failing storm can be replayed. Kinds: random bytes, truncated valid messages, wrong field
types, deep nesting, huge lists, extreme integers, bad framing, and protocol-level abuse (unknown
types, ghost LMCache workers, absurd full-sync batch counts).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec

KINDS = ("random", "truncated", "wrong_types", "deep_nesting", "huge_list", "extreme_ints", "bad_framing", "protocol")

_enc = msgspec.msgpack.encode
EXTREME_INTS = (-1, -(1 << 63), (1 << 63) - 1, (1 << 64) - 1, 1 << 32, -(1 << 31))
_WRONG_VALUES: tuple[Any, ...] = ("x", 1.5, [1, "a"], {"a": 1}, None, True, b"\x00", -7)


def deep(rng: random.Random, *, json: bool = False) -> bytes:
    """A nesting far beyond any schema: arrays or maps, msgpack or JSON."""
    depth = rng.choice((200, 2_000, 20_000, 200_000))
    if json:
        return (b'{"a":' * depth + b"1" + b"}" * depth) if rng.random() < 0.5 else b"[" * depth + b"]" * depth
    return b"\x91" * depth + b"\xc0" if rng.random() < 0.5 else b"\x81\xa1a" * depth + b"\x01"


def huge_array(n: int) -> bytes:
    """A msgpack array of ``n`` empty arrays: tiny on the wire, ``n`` objects if decoded blindly."""
    return b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n


def _mutate(rng: random.Random, msg: dict[str, Any]) -> dict[str, Any]:
    out = dict(msg)
    key = rng.choice([k for k in out if k != "type"] or ["type"])
    out[key] = rng.choice(_WRONG_VALUES)
    return out


def _nest_field(rng: random.Random, msg: dict[str, Any]) -> bytes:
    """``msg`` with one field's value replaced by a deep nesting (spliced into the msgpack)."""
    key = rng.choice([k for k in msg if k != "type"] or ["extra"])
    head = {k: v for k, v in msg.items() if k != key}
    body = _enc(head)
    # Rewrite the map header to hold one more entry, then append key + nested value.
    n = len(head) + 1
    assert n < 16 and body[0] == 0x80 | len(head)
    return bytes([0x80 | n]) + body[1:] + _enc(key) + deep(rng)


def _common(rng: random.Random, kind: str, valid: dict[str, Any], extreme: Callable[[], dict[str, Any]]) -> bytes:
    if kind == "random":
        return rng.randbytes(rng.randrange(0, 512))
    if kind == "truncated":
        full = _enc(valid) if rng.random() < 0.8 else msgspec.json.encode(valid)
        return full[: rng.randrange(0, max(1, len(full)))]
    if kind == "wrong_types":
        m = _mutate(rng, valid)
        return _enc(m) if rng.random() < 0.7 else msgspec.json.encode(m)
    if kind == "deep_nesting":
        r = rng.random()
        return deep(rng) if r < 0.3 else deep(rng, json=True) if r < 0.5 else _nest_field(rng, valid)
    if kind == "extreme_ints":
        return _enc(extreme())
    return huge_array(rng.choice((10_000, 100_000, 1_000_000)))


# ---- route socket (DEALER side: frames after the DEALER's identity) ------------------------------


def _route_valid(rng: random.Random) -> dict[str, Any]:
    return {"type": "route", "request_id": f"h{rng.getrandbits(32)}", "token_ids": [rng.randrange(50_000) for _ in range(rng.randrange(1, 64))]}


def route_message(rng: random.Random, kind: str) -> list[bytes]:
    """One hostile request as DEALER frames (``[b"", payload]`` unless the framing is the point)."""
    valid = _route_valid(rng)

    def extreme() -> dict[str, Any]:
        m = dict(valid)
        field = rng.choice(("prompt_tokens", "turn", "est_hit_tokens", "token_ids", "hashes"))
        v = rng.choice(EXTREME_INTS)
        if field == "token_ids":
            m["token_ids"] = [1, 2, v]
        elif field == "hashes":
            m.pop("token_ids")
            m["hashes"] = [{"scheme": "fast", "block_size": rng.choice((16, 0, -1, 1 << 40)), "hashes": [v, 3]}]
        else:
            m[field] = v
        return m

    if kind == "bad_framing":
        return rng.choice((
            [b"x", b"y", b"z"],
            [b"", b"", b"", _enc(valid)],
            [b"a"] * 12 + [b"", _enc(valid)],
            [b"", _enc(valid), b"trailing"],
        ))
    if kind == "huge_list":
        r = rng.random()
        if r < 0.4:
            m = dict(valid, token_ids=[7] * rng.choice((200_000, 2_000_000)))
            return [b"", _enc(m)]
        if r < 0.7:
            m = dict(valid, hashes=[{"scheme": "fast", "block_size": 16, "hashes": [5] * 1_000_000}])
            m.pop("token_ids")
            return [b"", _enc(m)]
    if kind == "protocol":
        m = rng.choice((
            {"type": "nope"}, {"type": "route"}, dict(valid, version=99), dict(valid, request_id=""),
            dict(valid, request_id="r" * 10_000), {"type": "done", "request_id": "never-routed"},
            dict(valid, hashes=[{"scheme": "fast", "block_size": 16, "hashes": [1]}] * 9),
            {"type": "stats", "unknown_field": 1},
        ))
        return [b"", _enc(m)]
    return [b"", _common(rng, kind, valid, extreme)]


# ---- vLLM KV events (PUB frames: topic, seq, payload) --------------------------------------------


def _kv_valid(rng: random.Random, block_size: int = 16) -> list[Any]:
    n = rng.randrange(1, 4)
    ev = {
        "type": "BlockStored", "block_hashes": [rng.getrandbits(64) for _ in range(n)], "parent_block_hash": None,
        "token_ids": [rng.randrange(50_000) for _ in range(n * block_size)], "block_size": block_size,
        "lora_id": None, "medium": "GPU",
    }
    return [1.7e9 + rng.random(), [ev], 0]


def kv_payload(rng: random.Random, kind: str) -> bytes:
    """One hostile event-batch payload (the framing kinds are in :func:`kv_message`)."""
    valid = _kv_valid(rng)
    ev = valid[1][0]
    if kind == "random":
        return rng.randbytes(rng.randrange(0, 512))
    if kind == "truncated":
        full = _enc(valid)
        return full[: rng.randrange(0, len(full))]
    if kind == "wrong_types":
        choice = rng.random()
        if choice < 0.3:
            return _enc(["ts", valid[1], 0])
        if choice < 0.6:
            return _enc([valid[0], {"events": 1}, 0])
        return _enc([valid[0], [_mutate(rng, ev)], 0])
    if kind == "deep_nesting":
        if rng.random() < 0.5:
            return deep(rng)
        return _enc([valid[0], [], 0])[:-2] + b"\x91" + _nest_field(rng, ev) + b"\x00"
    if kind == "huge_list":
        if rng.random() < 0.5:
            removed = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
            return _enc([valid[0], [removed] * rng.choice((70_000, 200_000)), 0])
        big = dict(ev, block_hashes=list(range(70_000)), token_ids=[1] * 1_120_000)
        return _enc([valid[0], [big], 0])
    if kind == "extreme_ints":
        bad = dict(ev)
        field = rng.choice(("token_ids", "block_hashes", "block_size", "parent_block_hash"))
        v = rng.choice(EXTREME_INTS)
        bad[field] = [v] * len(ev[field]) if isinstance(ev[field], list) else v
        return _enc([valid[0], [bad, ev], 0])
    # protocol: unknown event types, legacy array form gone wrong, digest hashes of odd sizes
    return _enc([valid[0], rng.choice(([{"type": "Nope"}], [["BlockStored"]], [dict(ev, block_hashes=[b"\x01" * 3])],
                                        [{"no": "type"}], [7])), 0])


def kv_message(rng: random.Random, kind: str, topic: bytes, seq: int) -> list[bytes]:
    """One hostile PUB message for a subscriber of ``topic``."""
    if kind == "bad_framing":
        return rng.choice((
            [topic], [topic, b"\x00" * 7, b"x"], [topic, seq.to_bytes(8, "big")],
            [topic, seq.to_bytes(8, "big"), b"a", b"b"], [topic + b"2", seq.to_bytes(8, "big"), b"\x90"],
        ))
    return [topic, seq.to_bytes(8, "big"), kv_payload(rng, kind)]


# ---- LMCache worker sockets (PULL payloads; ROUTER requests) -------------------------------------


def _lmc_ids(rng: random.Random) -> tuple[str, int]:
    # Mostly ghosts: ids nobody configured, each a new registry entry if kept.
    return f"ghost-{rng.getrandbits(40)}", rng.randrange(1 << 16)


def lmcache_push(rng: random.Random, kind: str) -> bytes:
    """One hostile PULL frame."""
    lmc, wid = _lmc_ids(rng)
    valid = {"type": "BatchedKVOperationMsg", "instance_id": lmc, "worker_id": wid, "location": "LocalCPUBackend",
             "operations": [{"op_type": "admit", "key": rng.getrandbits(63), "seq_num": i} for i in range(3)]}

    def extreme() -> dict[str, Any]:
        m = dict(valid, worker_id=rng.choice(EXTREME_INTS))
        m["operations"] = [{"op_type": "evict", "key": rng.choice(EXTREME_INTS), "seq_num": rng.choice(EXTREME_INTS)}]
        return m

    if kind == "huge_list":
        if rng.random() < 0.5:
            return _enc(dict(valid, operations=valid["operations"] * 30_000))
        return _enc({"type": "FullSyncBatchMsg", "instance_id": lmc, "worker_id": wid, "location": "L",
                     "sync_id": "s", "batch_id": 1 << 40, "keys": list(range(200_000))})
    if kind in ("protocol", "bad_framing"):
        return _enc(rng.choice((
            {"type": "DeRegisterMsg", "instance_id": lmc, "worker_id": wid, "ip": "x", "port": -1},
            {"type": "FullSyncEndMsg", "instance_id": lmc, "worker_id": wid, "location": "L", "sync_id": "s",
             "actual_total_keys": -1},
            {"type": "ClearMsg"}, {"type": "HeartbeatMsg"}, valid,
        )))
    return _common(rng, kind, valid, extreme)


def lmcache_request(rng: random.Random, kind: str) -> list[bytes]:
    """One hostile request for the LMCache ROUTER, as DEALER frames."""
    lmc, wid = _lmc_ids(rng)
    reg = {"type": "RegisterMsg", "instance_id": lmc, "worker_id": wid, "ip": "127.0.0.1", "port": 1,
           "peer_init_url": None}

    def extreme() -> dict[str, Any]:
        return dict(reg, worker_id=rng.choice(EXTREME_INTS), port=rng.choice(EXTREME_INTS))

    if kind == "bad_framing":
        return rng.choice(([b"a", b"b", b"c"], [_enc(reg), b"", b""], [b""]))
    if kind == "protocol":
        msg = rng.choice((
            reg, dict(reg, type="HeartbeatMsg"),
            {"type": "FullSyncStartMsg", "instance_id": lmc, "worker_id": wid, "location": "L", "sync_id": "s",
             "total_keys": 1, "batch_count": rng.choice((10**7, 10**12, -5))},
            {"type": "FullSyncStatusMsg", "instance_id": lmc, "worker_id": wid, "sync_id": "s"},
            {"type": "BatchedP2PLookupMsg", "hashes": list(range(1000)), "instance_id": lmc, "worker_id": wid},
            {"type": "PinMsg"},
        ))
        return [b"", _enc(msg)]
    if kind == "huge_list":
        return [b"", _enc({"type": "BatchedP2PLookupMsg", "hashes": list(range(300_000)), "instance_id": lmc,
                           "worker_id": wid})]
    return [b"", _common(rng, kind, reg, extreme)]


def storm_kinds(rng: random.Random, n: int, huge_share: float = 0.02) -> list[str]:
    """``n`` kinds, each at least once when ``n >= len(KINDS)``; huge messages (costly to build
    and to refuse) make up about ``huge_share`` of them."""
    out = list(KINDS) if n >= len(KINDS) else []
    light = [k for k in KINDS if k != "huge_list"]
    while len(out) < n:
        out.append("huge_list" if rng.random() < huge_share else rng.choice(light))
    rng.shuffle(out)
    return out


def target_config(model: str, block_size: int, pub_port: int, replay_port: int) -> dict[str, Any]:
    """A controller with every peer-facing socket open on loopback, as the storms attack it:
    instance ``a`` publishes KV events (with replay) on the given ports, ``b`` only exists, the
    LMCache worker sockets are on, and no engine is polled (nothing answers on their http ports)."""
    return {
        "model": model,
        "hashing": {"block_size": block_size},
        "instances": [
            {"id": "a", "http": "http://127.0.0.1:9", "kv_events": f"tcp://127.0.0.1:{pub_port}",
             "replay": f"tcp://127.0.0.1:{replay_port}"},
            {"id": "b", "http": "http://127.0.0.1:10"},
        ],
        "server": {"route_url": "tcp://127.0.0.1:*", "metrics_port": 0},
        "load": {"metrics_poll_s": 0, "instance_timeout_s": 0},
        "lmcache": {"enabled": True, "pull_url": "tcp://127.0.0.1:*", "reply_url": "tcp://127.0.0.1:*"},
    }
